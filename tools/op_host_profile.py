"""Developer probe: where the host time of the op layer's calls goes. First each call's
host µs without the profiler, the calls taking turns in seven rounds (medians; the op's
share above a torch mul's step and the kernel API's against a bare launch from the same
rounds, beside the op layer's host targets), then a cProfile of each (back-to-back calls,
one sync at the end). The calls: the packed op's forward + autograd.grad and its no-grad
forward (1x8192 tokens, d128, ratio 4, the launch probe's case); the floor of that step's
design, a Python autograd.Function that only allocates what the op allocates and launches
as many small kernels (the compressed-offsets kernel in place of each), no validation, no
plans; a bare launch of that small kernel; the same step through a kernel_api.PoolPlan
(the pack checked once) and the plan's forward / backward into caller buffers; the kernel
API's pool_forward / pool_backward into caller buffers, the training forward and streaming's fused prefill of 8 prompts of
4096 tokens at d512 ratio 4 (bench --streaming's case).

    python tools/op_host_profile.py [calls] [rows shown]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import _tool  # noqa: E402
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import sys

import torch


PLAN_STEP = "packed op through a PoolPlan, fwd + autograd.grad"
MUL, OP, FLOOR, BARE = ("autograd.grad of a torch mul", "packed op fwd + autograd.grad",
                        "floor: a Python Function with the op's allocations and launches",
                        "a bare TVM-FFI launch (the compressed-offsets kernel, 2 offsets)")


def host_us(fn, calls):
    return _tool.host_us(fn, calls, torch.cuda.synchronize)


def cases():
    from csa_compressor import compress_thd_fused, compress_thd_fused_packed
    from csa_compressor.layout import compressed_capacity, compressed_cu_seqlens
    try:  # an older tree (BASE_SRC) may predate the kernel API, streaming and small kernels
        from csa_compressor import streaming
        from csa_compressor.kernel_api import PoolPlan, pool_backward, pool_forward
        from csa_compressor.kernels.jit import small_kernel
        from csa_compressor.kernels.offsets import CompressedOffsets, compile_args
    except ImportError as e:
        print(f"floor, kernel API and streaming cases skipped: {e}")
        streaming = None

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    d, ratio, coff, T = 128, 4, 2, 8192
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    cuc = compressed_cu_seqlens(cu, ratio)
    n = compressed_capacity(T, 1, T, ratio)
    kvs = torch.randn(T, 2 * coff * d, device=dev, generator=g).bfloat16()
    ape = torch.randn(ratio, coff * d, device=dev, generator=g)
    g_rows = torch.randn(n, d, device=dev, generator=g).bfloat16()
    small = torch.randn(64, device=dev, requires_grad=True)
    g_small = torch.randn(64, device=dev)

    def op_step():
        k = kvs.detach().requires_grad_(True)
        out = compress_thd_fused_packed(k, ape, cu, cuc, n, ratio=ratio, coff=coff)
        torch.autograd.grad(out, k, g_rows)

    if streaming is not None:
        launch = small_kernel(("offsets", ratio), dev,
                              lambda: (CompressedOffsets(ratio), compile_args()))
        tiny = torch.empty_like(cu)
        floor_step = _tool.floor_step(lambda t: launch(cu, tiny), kvs, ape, g_rows)

    kv, score = kvs[:, :coff * d].contiguous(), kvs[:, coff * d:].contiguous()
    bufs = [torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)]
    out = torch.empty(n, d, device=dev, dtype=torch.bfloat16)
    yield MUL, lambda: torch.autograd.grad(small * 2, small, g_small)
    yield OP, op_step
    if streaming is not None:
        yield FLOOR, floor_step
        yield BARE, lambda: launch(cu, tiny)
    yield "packed op, no grad", lambda: compress_thd_fused_packed(kvs, ape, cu, cuc, n, ratio=ratio,
                                                                   coff=coff)
    if streaming is None:
        return
    planned = PoolPlan([0, T], ratio=ratio, coff=coff, head_dim=d, dtype=torch.bfloat16)

    def plan_step():
        k = kvs.detach().requires_grad_(True)
        torch.autograd.grad(planned.pool_packed(k, ape), k, g_rows)

    yield PLAN_STEP, plan_step
    yield "PoolPlan.forward", lambda: planned.forward(kv, score, ape, out)
    yield "PoolPlan.backward", lambda: planned.backward(kv, score, ape, g_rows, *bufs)
    yield "kernel API pool_forward", lambda: pool_forward(kv, score, ape, cu, cuc, out,
                                                          ratio=ratio, coff=coff)
    yield "kernel API pool_backward", lambda: pool_backward(kv, score, ape, cu, cuc, g_rows, *bufs,
                                                            ratio=ratio, coff=coff)
    D, B, S = 512, 8, 4096
    pk = torch.randn(B * S, 2 * D, device=dev, generator=g).bfloat16()
    ps = torch.randn(B * S, 2 * D, device=dev, generator=g).bfloat16()
    pape = torch.randn(ratio, 2 * D, device=dev, generator=g)
    pcu = torch.arange(B + 1, dtype=torch.int32, device=dev) * S
    pcuc = pcu // ratio
    st = streaming.StreamState(B, D, ratio=ratio, coff=coff, device=dev)
    cu_host, slots = pcu.tolist(), list(range(B))
    yield "training forward 8x4096 d512 r4", lambda: compress_thd_fused(
        pk, ps, pape, pcu, pcuc, B * (S // ratio), ratio=ratio, coff=coff)
    yield "prefill fused 8x4096 d512 r4 (after reset)", lambda: (st.reset(), streaming.prefill(
        st, pk, ps, pape, cu_host, slots, pooling="fused"))


def interleaved(named: dict, calls: int, rounds: int = 7) -> dict:
    """{name: [µs a call, a round]}: the cases take turns, one batch each a round, so a
    host that speeds up or slows down (by tens of percent within a loan) moves them alike."""
    got = {name: [] for name in named}
    for fn in named.values():
        host_us(fn, 20)
    for _ in range(rounds):
        for name, fn in named.items():
            got[name].append(_tool.host_us(fn, calls, torch.cuda.synchronize, warm=0, rounds=1))
    return got


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def main(calls=200, shown=30):
    named = dict(cases())
    got = interleaved(named, calls)
    for name, us in got.items():
        print(f"===== {name}: {_median(us):.1f} µs a call (median of {len(us)} rounds, "
              f"{min(us):.1f}-{max(us):.1f}) =====")
    if FLOOR in got:
        rounds = range(len(got[MUL]))
        op = _median([got[OP][r] - got[MUL][r] for r in rounds])
        floor = _median([got[FLOOR][r] - got[MUL][r] for r in rounds])
        planned = _median([got[PLAN_STEP][r] - got[MUL][r] for r in rounds])
        print(f"above the torch mul's step, median of the rounds: the op {op:.1f} µs, the floor "
              f"of its design {floor:.1f} µs, the op through a PoolPlan {planned:.1f} µs "
              "(target for the op: 40)")
        for name in ("kernel API pool_forward", "kernel API pool_backward", "PoolPlan.forward",
                     "PoolPlan.backward"):
            x = _median([got[name][r] / got[BARE][r] for r in rounds])
            print(f"{name}: {x:.1f}x a bare launch (target 2x)")
    for name, fn in named.items():
        print(f"\n===== cProfile: {name} =====")
        _tool.print_cprofile(fn, calls, torch.cuda.synchronize, (shown, shown))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
