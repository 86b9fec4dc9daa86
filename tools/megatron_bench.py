"""Megatron-LM's own Compressor, forward + backward on the GPU: its eager pooling against
csa_compressor.megatron installed, installed with the fused epilogue
(``install(epilogue=True)``), and with the epilogue and one projection GEMM
(``install(epilogue=True, projection=True)``), side by side in one run.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python tools/megatron_bench.py [--tokens 3x8192]
        [--kernels]   # also each THD step's kernels by name, with every fusion on
        [--float16-module]   # the norm weight in bf16, as Megatron's Float16Module leaves it
        [--ddp]   # inside Megatron's DistributedDataParallel (distributed optimizer): the
                  # parameters views of its buffers, their gradients into main_grad

Configs (hidden 4096, bf16, rope_dim 64): d 512 ratio 4; d 128 ratio 4 with rotate (where
fast_hadamard_transform does not import, the same transform in plain torch stands in for
eager and installed alike, and the row says so); d 512 ratio 128; on the THD path
(packed_seq_params, static capacity, as Megatron's forward passes), on the
context-parallel pre-grouped path (``_forward_thd(..., compressed_group_ids=ids)``, the
same tokens as groups) and on the SBHD path (no packed_seq_params: the B sequences as
``(L, B, hidden)``). Per step: wall time (CUDA events around 10 back-to-back steps, the
median over 7 rounds in which the four setups take turns, and the median of the rounds'
installed / eager ratios; host time included, no CUDA graph: Megatron's step is not
capturable as called), GPU time (the sum of the step's kernel and memory-op durations from
torch.profiler over 3 steps) and kernel launches. A row is reported only where the
installed steps really ran the fused pooling and, where asked, the fused epilogue and the
one projection GEMM (a fallback is an error in the row).
"""

from __future__ import annotations

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True, own_help=True)


import argparse
import contextlib
import os
import statistics
import sys
import tempfile

import torch

from csa_compressor.cli.module_bench import profile_steps, steps_us

HIDDEN, ROPE_DIM = 4096, 64
CONFIGS = (("d512 r4", 512, 4, False), ("d128 r4 rotate", 128, 4, True), ("d512 r128", 512, 128, False))


def _csa():
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    import megatron.core.transformer.experimental_attention_variant.csa as csa

    return csa


VARIANTS = ("eager", "installed", "epilogue", "projection")
ROUNDS = 7  # wall-time rounds, the four variants in turn in each


def _contexts(megatron) -> dict:
    return {"eager": contextlib.nullcontext, "installed": megatron.installed,
            "epilogue": lambda: megatron.installed(epilogue=True),
            "projection": lambda: megatron.installed(epilogue=True, projection=True)}


def _variants(step, megatron, ddp) -> dict:
    """Each variant's GPU time and launches (torch.profiler), checked to have run what it
    names, then the wall times: ROUNDS rounds of 10 back-to-back steps of each variant in
    turn, so a slow spell of the host falls on every variant of a round alike; a variant's
    wall is the median over the rounds, and ``wall_ratio`` the median of the rounds'
    installed / eager."""
    from csa_compressor import dispatch, module

    ctx, out = _contexts(megatron), {}
    launched, fused = [], dispatch.fused_from_validated
    concatenated, joint = [], module.joint_projection
    dispatch.fused_from_validated = lambda p, *a, **k: launched.append(p.total_comp) or fused(p, *a, **k)
    module.joint_projection = lambda *a: concatenated.append(1) or joint(*a)
    try:
        for key in VARIANTS:
            megatron.clear_fallback_reasons()
            with ctx[key]():
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                gpu, launches = profile_steps(step)
            out[key] = {"gpu_us": gpu, "launches": launches}
            if key == "installed" and not launched:
                raise RuntimeError(f"the fused pooling never ran: {megatron.fallback_reasons()}")
            if key in ("epilogue", "projection") and megatron.fallback_reasons():
                raise RuntimeError(f"a fallback: {megatron.fallback_reasons()}")
    finally:
        dispatch.fused_from_validated = fused
        module.joint_projection = joint
    # in DDP's buffer the GEMM reads the two weights in place
    out["concatenated"] = bool(concatenated)
    if ddp and concatenated:
        raise RuntimeError("the weights were concatenated inside DDP's buffer")
    walls = {key: [] for key in VARIANTS}
    for _ in range(ROUNDS):
        for key in VARIANTS:
            with ctx[key]():
                step()  # one untimed step after the switch
                walls[key].append(steps_us(step, repeats=1))
    for key in VARIANTS:
        out[key]["wall_us"] = statistics.median(walls[key])
    out["wall_ratio"] = statistics.median(i / e for i, e in zip(walls["installed"], walls["eager"]))
    return out


def kernel_table(step, n=3) -> list:
    """(name, launches a step, GPU µs a step) of ``step()``'s kernels and memory ops,
    most time first (torch.profiler over ``n`` calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            c, t = by.get(e.name, (0, 0.0))
            by[e.name] = (c + 1, t + e.self_device_time_total)
    return sorted(((k, c / n, t / n) for k, (c, t) in by.items()), key=lambda r: -r[2])


def run(lens, configs=CONFIGS, device="cuda", hidden=HIDDEN, rope_dim=ROPE_DIM, kernels=False,
        float16_module=False, ddp=False):
    csa = _csa()
    from megatron.core.packed_seq_params import PackedSeqParams

    from csa_compressor import megatron
    from csa_compressor.testing import megatron_compressor, megatron_one_process

    megatron_one_process(tempfile.mkdtemp())
    try:
        import fast_hadamard_transform  # noqa: F401
        standin = False
    except ImportError:  # Megatron's rotate_activation calls dsa.hadamard_transform
        import importlib

        from csa_compressor.epilogue import walsh_hadamard

        dsa = importlib.import_module(csa.__name__.rsplit(".", 1)[0] + ".dsa")
        dsa.hadamard_transform = lambda v, scale=1.0: (
            walsh_hadamard(v) * scale).view(v.shape).to(v.dtype)
        standin = True
    dev = torch.device(device)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    rows = []
    for name, d, ratio, rotate in configs:
        if rotate and standin:
            name = name.replace("rotate", "rotate (torch Hadamard stand-in)")
        comp = megatron_compressor(csa, hidden, d, ratio, rope_dim, rotate=rotate,
                                   dtype=torch.bfloat16).to(dev)
        if float16_module:  # Float16Module casts every parameter but ape (kept in fp32)
            comp.norm.weight.data = comp.norm.weight.data.to(torch.bfloat16)
        wrapper = None
        if ddp:
            from megatron.core.distributed import (DistributedDataParallel,
                                                   DistributedDataParallelConfig)

            wrapper = DistributedDataParallel(comp.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, grad_reduce_in_fp32=True), comp)

        def zero():
            if wrapper is not None:
                wrapper.zero_grad_buffer()
            comp.zero_grad(set_to_none=True)
        x = torch.randn(T, 1, hidden, device=dev).to(torch.bfloat16).requires_grad_(True)
        # the pre-grouped path: every sequence's full blocks as groups, ids their block index
        ids = torch.cat([torch.arange(n // ratio, dtype=torch.int32) for n in lens]).to(dev)
        xg = torch.randn(ids.numel() * ratio, 1, hidden, device=dev).to(torch.bfloat16)
        xg.requires_grad_(True)
        cug = torch.tensor([0, xg.shape[0]], dtype=torch.int32, device=dev)
        xs = torch.randn(max(lens), len(lens), hidden, device=dev).to(torch.bfloat16)
        xs.requires_grad_(True)
        grads = {}

        def thd():
            x.grad = None
            zero()
            out, _ = comp(x, psp)
            if "thd" not in grads:
                grads["thd"] = torch.randn_like(out)
            out.backward(grads["thd"])

        def grouped():
            xg.grad = None
            zero()
            out, _ = comp._forward_thd(xg, cug, max_seqlen_q=max(lens), compressed_group_ids=ids)
            if "grouped" not in grads:
                grads["grouped"] = torch.randn_like(out)
            out.backward(grads["grouped"])

        def sbhd():
            xs.grad = None
            zero()
            out = comp(xs)
            out = out[0] if isinstance(out, tuple) else out
            if "sbhd" not in grads:
                grads["sbhd"] = torch.randn_like(out)
            out.backward(grads["sbhd"])

        for path, step in (("thd", thd), ("grouped", grouped), ("sbhd", sbhd)):
            row = {"config": name, "path": path}
            try:
                row.update(_variants(step, megatron, ddp))
                if kernels and path == "thd":
                    with megatron.installed(epilogue=True, projection=True):
                        table = kernel_table(step)
                    print(f"{name} thd, install(epilogue=True, projection=True): kernels "
                          "a step (launches, GPU µs)", file=sys.stderr)
                    for k, c, t in table:
                        print(f"  {c:5.1f} {t:8.1f}  {k[:110]}", file=sys.stderr)
            except Exception as exc:  # report, never hide
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print(_row(row), file=sys.stderr, flush=True)
        comp = x = xg = xs = wrapper = None  # free them before the next config
        torch.cuda.empty_cache()
    return rows



def _row(r):
    if "error" in r:
        return f"| {r['config']} | {r['path']} | {r['error']} | | | | |"
    m = [r[v] for v in VARIANTS]

    def cells(key):
        return " / ".join(f"{v[key]:.0f}" for v in m)

    speedup = " / ".join(f"{m[0]['gpu_us'] / v['gpu_us']:.2f}x" for v in m[1:])
    return (f"| {r['config']} | {r['path']} | {cells('wall_us')} | {r['wall_ratio']:.2f} "
            f"| {cells('gpu_us')} | {speedup} | {cells('launches')} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="3x8192", help="BxL: B sequences of L tokens")
    ap.add_argument("--kernels", action="store_true",
                    help="also each THD step's kernels by name, with every fusion on")
    ap.add_argument("--float16-module", action="store_true",
                    help="the norm weight in bf16, as Megatron's Float16Module leaves it "
                         "(default: fp32, as the module is built)")
    ap.add_argument("--ddp", action="store_true",
                    help="inside Megatron's DistributedDataParallel (distributed optimizer): "
                         "the parameters views of its buffers, their gradients into main_grad")
    args = ap.parse_args(argv)
    b, n = (int(v) for v in args.tokens.split("x"))
    if not torch.cuda.is_available():
        print("megatron_bench: no CUDA GPU visible, nothing was run", file=sys.stderr)
        return 2
    from csa_compressor.cli.bench import environment

    env = environment()
    rows = run([n] * b, kernels=args.kernels, float16_module=args.float16_module, ddp=args.ddp)
    print(f"GPU {env.get('gpu')}, torch {env['torch']}, CuTe DSL {env['cutlass_dsl']}, commit "
          f"{env['commit']}, {env['date']}; Megatron's Compressor, hidden {HIDDEN}, bf16, "
          f"{args.tokens} tokens, forward + backward a step, norm weight "
          f"{'bf16 (Float16Module)' if args.float16_module else 'fp32'}"
          f"{', inside Megatron DDP (distributed optimizer)' if args.ddp else ''}")
    cols = "eager / installed / + epilogue / + epilogue + projection"
    print(f"| config | path | wall µs {cols} | wall installed / eager | GPU µs {cols} | GPU "
          f"speedup over eager: installed / + epilogue / + epilogue + projection | kernels a "
          f"step {cols} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
