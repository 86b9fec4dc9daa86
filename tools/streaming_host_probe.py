"""Developer probe (H200): where a streaming call's time goes, for each pooling path.

For prefill (8 prompts into empty slots, head_dim 512, ratio 4 and 128) and an eager
decode step (256 slots, one token each): the host µs a call (perf_counter over back-to-back
calls, one sync at the end), the wall µs (CUDA events around one call, as the bench), and
the CUDA kernels a call launches (torch.profiler), beside the training forward over the
same tokens; for the training forward and a prefill, the host µs from the call's start to
its pooling launch and other points (MARKS), which is the host's share of the bench's
wall time.

    python tools/streaming_host_probe.py [prompt_tokens]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import sys
import time

import torch

from csa_compressor import streaming
from csa_compressor.cli.bench import wall_clock
from csa_compressor.ops import compress_thd_fused

D, B, SLOTS = 512, 8, 256


def host_us(fn, calls=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def kernels(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("Memcpy") and not e.name.startswith("Memset"))


def cases(S):
    dev = torch.device("cuda")
    for ratio, coff in ((4, 2), (128, 1)):
        W = coff * D
        g = torch.Generator(device=dev).manual_seed(0)
        kv = torch.randn(B * S, W, device=dev, generator=g).bfloat16()
        sc = torch.randn(B * S, W, device=dev, generator=g).bfloat16()
        ape = torch.randn(ratio, W, device=dev, generator=g)
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * S
        cuc = torch.arange(B + 1, dtype=torch.int32, device=dev) * (S // ratio)
        st = streaming.StreamState(B, D, ratio=ratio, coff=coff, device=dev)
        cu_host, slots = cu.tolist(), list(range(B))
        yield f"training forward {B}x{S} r{ratio}", lambda: compress_thd_fused(
            kv, sc, ape, cu, cuc, B * (S // ratio), ratio=ratio, coff=coff)
        yield f"reset {B} slots r{ratio} (inside each prefill row)", st.reset
        yield f"prefill phases {B}x{S} r{ratio}", (st, lambda st=st: streaming.prefill(
            st, kv, sc, ape, cu_host, slots, pooling="ring"))
        for pooling in ("ring", "fused"):
            yield f"prefill {pooling} {B}x{S} r{ratio}", (
                lambda p=pooling, st=st: (st.reset(), streaming.prefill(
                    st, kv, sc, ape, cu_host, slots, pooling=p)))
        dst = streaming.StreamState(SLOTS, D, ratio=ratio, coff=coff, device=dev)
        kv1 = torch.randn(SLOTS, 1, W, device=dev, generator=g).bfloat16()
        for pooling in ("ring", "fused"):
            yield f"decode eager {pooling} {SLOTS} slots r{ratio}", (
                lambda p=pooling: streaming.decode(dst, kv1, kv1, ape, pooling=p))


def timeline(name, fn):
    """One call's CPU ops (torch.profiler, top level only) and CUDA kernels in time order,
    µs from the call's first op: where the host spends a call and when the GPU runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted(prof.events(), key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start
    print(f"\n--- timeline of one {name} (µs from its first op) ---")
    for e in evs:
        cuda = e.device_type == torch.autograd.DeviceType.CUDA
        if not cuda and e.cpu_parent is not None:
            continue
        print(f"{'GPU' if cuda else 'cpu'} {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:90]}")


def phases(name, st, fn, calls=100):
    """Host µs a call spends in each piece of prefill (inclusive, perf_counter, no syncs
    inside), each call after the slots' reset and a sync, as the bench times it."""
    from csa_compressor import ops, pooling
    from csa_compressor.streaming import chunks, ring, rows, state as state_mod

    spent = {}

    def timed(key, f):
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return w

    patches = [(chunks, n) for n in ("_inputs", "plan", "settings", "_pool", "pool_rows",
                                     "device_ints", "_fresh", "pool_kept")]
    patches += [(ring, "tail"), (ring, "tail_launcher"), (rows, "pool_rows"),
                (ops, "fused_from_problem"), (pooling, "launch_forward"),
                (state_mod.StreamState, "counts_of"), (state_mod.StreamState, "host_slots")]
    saved = [(m, n, getattr(m, n)) for m, n in patches if hasattr(m, n)]
    for m, n, f in saved:
        setattr(m, n, timed(f"{getattr(m, '__name__', m)}.{n}", f))
    total = 0.0
    try:
        for i in range(calls + 5):
            st.reset()
            torch.cuda.synchronize()
            if i == 5:
                spent.clear()
                total = 0.0
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    print(f"\n--- host µs a call in each piece of {name} (inclusive; {calls} calls) ---")
    print(f"{'the whole call':60s} {total / calls * 1e6:8.1f}")
    for key, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{key:60s} {v / calls * 1e6:8.1f}")


# where a prefill call stands when it passes these points (entry or exit of the function)
MARKS = (("streaming.chunks", "_inputs", "exit"), ("streaming.chunks", "settings", "exit"),
         ("streaming.chunks", "_fresh", "enter"), ("streaming.chunks", "device_ints", "exit"),
         ("streaming.chunks", "pool_kept", "enter"), ("kernels.launch", "launch_found", "exit"),
         ("streaming.ring", "tail", "exit"))


def to_launch(name, fn, setup=None, calls=200):
    """Median host µs from a call's start to each of MARKS (first time reached), and to
    its end, each call after ``setup`` and a sync, as the bench's wall clock times it:
    the time to the pooling's launch is the host share of that wall time."""
    import importlib

    got, seen = {}, {}
    saved = []
    for mod_name, fname, where in MARKS:
        mod = importlib.import_module(f"csa_compressor.{mod_name}")
        f = getattr(mod, fname, None)
        if f is None:
            continue
        key = f"{fname} {where}"

        def hooked(*a, _f=f, _key=key, _enter=where == "enter", **k):
            if _enter:
                seen.setdefault(_key, time.perf_counter())
            out = _f(*a, **k)
            if not _enter:
                seen.setdefault(_key, time.perf_counter())
            return out
        saved.append((mod, fname, f))
        setattr(mod, fname, hooked)
    try:
        for i in range(calls + 5):
            if setup is not None:
                setup()
            torch.cuda.synchronize()
            seen.clear()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if i >= 5:
                for k, v in list(seen.items()) + [("the call's end", t1)]:
                    got.setdefault(k, []).append((v - t0) * 1e6)
        torch.cuda.synchronize()
    finally:
        for mod, fname, f in saved:
            setattr(mod, fname, f)
    print(f"\n--- {name}: median host µs from the call's start to each point ({calls} calls) ---")
    for k, v in sorted(got.items(), key=lambda kv: sorted(kv[1])[len(kv[1]) // 2]):
        print(f"{k:44s} {sorted(v)[len(v) // 2]:8.1f}")


def main():
    S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    print(f"{'call':44s} {'host µs':>9s} {'wall µs':>9s} {'kernels':>8s}")
    for name, fn in cases(S):
        if name.startswith("prefill phases"):
            st, call = fn
            to_launch(name.replace("phases", "to launch"), call, st.reset)
            phases(name, *fn)
            continue
        if name.startswith("training forward"):
            to_launch(name + " to launch", fn)
        print(f"{name:44s} {host_us(fn):9.1f} {wall_clock(fn):9.1f} {kernels(fn):8d}")
        if name.startswith(("prefill ring", "training forward")):
            timeline(name, fn)  # now: the cases' closures see the loop's latest tensors


main()
