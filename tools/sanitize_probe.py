"""Small ragged packs through every kernel family, for compute-sanitizer (memcheck):
short-window fwd/bwd (ratio 4 coff 2 at d=128 and 512, ratio 3 coff 1, odd head_dim in
all three dtypes, where buffer sizes are not multiples of their alignment), long-window
fwd/bwd (ratio 128), capacity padding rows, N below the true count, T < ratio; then
the same packs through a kernel_api.PoolPlan (its forward, backward and packed op); then
offsets a caller got wrong (tests/packs.py CORRUPT_OFFSETS), where only staying in
bounds counts (d=64, and d=512 at ratio 4 coff 2); all of it twice, the second time with
the backward's large-pack variant forced (BWD_LARGE_PACK_ROWS = 0) and every grid
sized for a 4-SM GPU (CTAs walk many rows, across segments). CSA_CONFIG="K=V,..." runs it
with the tuning's constants overridden."""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import os
import sys

import torch

import csa_compressor as C
from csa_compressor import kernel_api
from csa_compressor.testing import make_inputs, parse_shape
from csa_compressor.kernels import launch, tuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from packs import CORRUPT_OFFSETS  # noqa: E402


bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# Twice: with the backward's large-pack variant where packs reach its threshold (none of
# these do) and the GPU's own schedules, then the variant forced on every pack that has
# one (threshold 0) and the schedules of a 4-SM GPU.
sm_count = launch.sm_count
base = tuning.current()
for large_from, sms in ((base.BWD_LARGE_PACK_ROWS, None), (0, 4)):
    # handed to the kernel-level API (the op has no tuning argument: the process's is fixed)
    t = tuning.replace(base, BWD_LARGE_PACK_ROWS=large_from,
                       BWD_LARGE_GUESS_PACK_ROWS=min(large_from, base.BWD_LARGE_GUESS_PACK_ROWS))
    launch.sm_count = sm_count if sms is None else (lambda index, sms=sms: sms)
    print("backward large-pack variant from", large_from, "rows; schedules for", sms or "all", "SMs")
    for spec, extra, dtype in (("37+0+3+64+129+1:128:4:2", 3, bf16), ("37+0+3+64+129+1:128:3:2", 2, bf16),
                               ("37+0+3+64+129+1:128:1:1", 2, bf16), ("37+0+3+64+129+1:64:5:1", 1, fp32),
                               ("37+0+3+64+129+1:128:2:2", 2, bf16),
                               ("37+0+3+64+129+1:65:3:1", 2, bf16),
                               ("37+0+3+64+129+1:65:4:2", 2, fp32), ("37+0+3+64+129+1:65:3:1", 1, fp32),
                               ("37+0+3+64+129+1:65:5:2", 1, fp16), ("300+0+127+259:64:128:1", 2, bf16),
                               ("300+5+260:64:128:2", 1, bf16), ("2:64:4:2", 2, bf16),
                               ("8192+3000+0+127+1100:512:128:1", 3, bf16),
                               ("37+0+3+64+129+1:512:4:2", 2, bf16),
                               ("64+64:128:4:2", -9, bf16)):
        s = parse_shape(spec)
        kv, score, ape, cu, cuc, N, _ = make_inputs(s, dtype, torch.device("cuda"))
        N = max(0, N + extra)
        out = torch.empty(N, s.d, dtype=dtype, device="cuda")
        kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=s.ratio, coff=s.coff, tuning=t)
        dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
        kernel_api.pool_backward(kv, score, ape, cu, cuc, torch.randn_like(out), dkv, dsc, dape,
                                 ratio=s.ratio, coff=s.coff, tuning=t)
        if extra >= 0:  # a PoolPlan of the pack: the same kernels on the plan's own offsets
            plan = kernel_api.PoolPlan(cu.cpu(), ratio=s.ratio, coff=s.coff, head_dim=s.d,
                                       dtype=dtype, num_tokens=kv.shape[0], total_comp=N, tuning=t)
            plan.forward(kv, score, ape, torch.empty_like(out))
            plan.backward(kv, score, ape, torch.randn_like(out), torch.empty_like(kv),
                          torch.empty_like(score), torch.empty_like(ape))
            if (s.coff * s.d * kv.element_size()) % 16 == 0:
                kvs = torch.cat((kv, score), 1).requires_grad_(True)
                plan.pool_packed(kvs, ape).backward(torch.randn_like(out))
        torch.cuda.synchronize()
        # a capacity cut below the true row count is malformed: NaN rows by default
        want = "nan" if extra < 0 else "finite"
        got = "nan" if bool(out.isnan().all()) else "finite" if bool(torch.isfinite(out).all()) \
            and bool(torch.isfinite(dkv).all()) else "mixed"
        print(spec, dtype, "N", N, "expect", want, "got", got, "ok" if want == got else "MISMATCH")

    for ratio, coff, d in ((4, 2, 64), (1, 1, 64), (128, 1, 64), (4, 2, 512)):
        W = coff * d
        kv = torch.randn(300, W, device="cuda").to(torch.bfloat16)
        score = torch.randn_like(kv)
        ape = torch.randn(ratio, W, device="cuda")
        for cu_l, cuc_l in CORRUPT_OFFSETS:
            cu = torch.tensor(cu_l, dtype=torch.int32, device="cuda")
            cuc = torch.tensor(cuc_l, dtype=torch.int32, device="cuda")
            out = torch.empty(40, d, dtype=torch.bfloat16, device="cuda")
            kernel_api.pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
            dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
            kernel_api.pool_backward(kv, score, ape, cu, cuc, torch.randn_like(out), dkv, dsc, dape,
                            ratio=ratio, coff=coff)
        torch.cuda.synchronize()
        print("corrupt offsets", ratio, coff, d, "done")

    # SBHD: B sequences read in place (one a grid.z index), tails, S < ratio, the packed
    # [kv | score] form, the slot-parallel kernels.
    for S, B, d, ratio, coff, dtype in ((37, 3, 128, 4, 2, bf16), (1030, 2, 512, 4, 2, bf16),
                                        (300, 3, 512, 128, 1, bf16), (70, 5, 64, 16, 2, fp32),
                                        (50, 4, 96, 3, 2, fp16), (3, 2, 128, 4, 2, bf16)):
        W = coff * d
        kv = torch.randn(S, B, W, device="cuda").to(dtype)
        score = torch.randn_like(kv)
        leaves = [kv.requires_grad_(True), score.requires_grad_(True),
                  torch.randn(ratio, W, device="cuda").requires_grad_(True)]
        out = C.compress_sbhd_fused(*leaves, ratio=ratio, coff=coff)
        out.backward(torch.randn_like(out))
        kvs = torch.cat((kv.detach(), score.detach()), 2).requires_grad_(True)
        out = C.compress_sbhd_fused_packed(kvs, leaves[2], ratio=ratio, coff=coff)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print("sbhd", S, B, d, ratio, coff, dtype, "ok", bool(torch.isfinite(kvs.grad).all()))

    # Malformed context-parallel group ids through the Megatron adapter's pooling (its
    # pre-grouped path: grouped_offsets, then megatron.hooks._fused_or_fallback) and
    # compress_grouped: huge, negative, int32 extremes, unsorted.
    from csa_compressor import megatron
    from csa_compressor.grouped import grouped_offsets

    for ratio, coff, d in ((4, 2, 128), (128, 1, 64)):
        for ids_l in ([0, 2**31 - 1, -2**31, 5, 5, -1], [7, 3, 2**30, -5, 0, 1],
                      [-1, -1, -1, -1, -1, -1], [2**31 - 1] * 6):
            ids = torch.tensor(ids_l, dtype=torch.int32, device="cuda")
            G, W = ids.numel(), coff * d
            kv = torch.randn(G * ratio, W, device="cuda").to(torch.bfloat16).requires_grad_(True)
            score = torch.randn_like(kv).requires_grad_(True)
            ape = torch.randn(ratio, W, device="cuda").requires_grad_(True)
            cu, cuc = grouped_offsets(ids, ratio)
            out = megatron.hooks._fused_or_fallback(kv, score, ape, cu, cuc, G, ratio, coff)
            assert out is not None, megatron.fallback_reasons()
            out.backward(torch.randn_like(out))
            out = C.compress_grouped(kv, score, ape, ids, ratio=ratio, coff=coff)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print("malformed group ids", ratio, coff, d, "done")
