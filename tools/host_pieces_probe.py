"""Developer probe (GPU): host µs of the pieces a streaming prefill is built from, each
alone, back to back (tools/_tool.host_us): the ways to upload a short host int list, a
small device allocation, a slice, the event calls, and the compiled pooling and tail
launches with and without the package's lookups around them. Says which piece to cut.

    python tools/host_pieces_probe.py
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import host_us, start  # noqa: E402

start(__doc__, gpu=True)

import array
import ctypes

import torch

from csa_compressor import streaming
from csa_compressor.kernels.launch import launch_forward
from csa_compressor.streaming.uploads import Staging
from csa_compressor.validation import Problem

CALLS = 300


def row(name, fn):
    print(f"{name:64s} {host_us(fn, CALLS, torch.cuda.synchronize):8.2f}", flush=True)


def uploads(dev):
    values = list(range(58))  # a prefill of 8 slots: 2 x 9 offsets and 5 ints a slot
    staging = Staging(dev)
    row("Staging.upload (pinned buffer, empty + copy_, event)",
        lambda: staging.upload(values, torch.int32))
    from csa_compressor.streaming.uploads import CudaRuntime

    raw_staging = Staging(dev, raw=CudaRuntime.make(dev))
    for scratch in (False, True):
        got = raw_staging.upload(values, torch.int32, scratch)
        torch.cuda.synchronize()
        assert got.tolist() == values
    row("Staging(raw=CudaRuntime).upload (empty + cudaMemcpyAsync, event)",
        lambda: raw_staging.upload(values, torch.int32))
    row("Staging(raw=CudaRuntime).upload, scratch (the device twin)",
        lambda: raw_staging.upload(values, torch.int32, True))
    row("torch.tensor(pin_memory=True).to(non_blocking)",
        lambda: torch.tensor(values, dtype=torch.int32, pin_memory=True).to(dev, non_blocking=True))
    pin = torch.empty(1 << 13, dtype=torch.int32, pin_memory=True)
    dbuf = torch.empty(1 << 13, dtype=torch.int32, device=dev)
    n = len(values)

    def prealloc():
        arr = array.array("i", values)
        ctypes.memmove(pin.data_ptr(), arr.buffer_info()[0], 4 * n)
        out = dbuf[:n]
        out.copy_(pin[:n], non_blocking=True)
        return out

    row("preallocated device buffer, slice.copy_(pinned slice)", prealloc)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        print(f"cuda.bindings: not importable ({e})")
        return
    kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
    raw_stream = torch._C._cuda_getCurrentRawStream
    idx = dev.index or 0
    hp, dp = pin.data_ptr(), dbuf.data_ptr()

    def raw():
        arr = array.array("i", values)
        ctypes.memmove(hp, arr.buffer_info()[0], 4 * n)
        err, = cudart.cudaMemcpyAsync(dp, hp, 4 * n, kind, raw_stream(idx))
        return dbuf[:n]

    row("preallocated, cudaMemcpyAsync (cuda.bindings) + slice", raw)

    def fresh_raw():
        arr = array.array("i", values)
        ctypes.memmove(hp, arr.buffer_info()[0], 4 * n)
        out = torch.empty(n, dtype=torch.int32, device=dev)
        cudart.cudaMemcpyAsync(out.data_ptr(), hp, 4 * n, kind, raw_stream(idx))
        return out

    row("torch.empty + cudaMemcpyAsync (cuda.bindings)", fresh_raw)
    row("  cudaMemcpyAsync alone", lambda: cudart.cudaMemcpyAsync(dp, hp, 4 * n, kind, raw_stream(idx)))
    row("  array + memmove alone", lambda: ctypes.memmove(hp, array.array("i", values).buffer_info()[0], 4 * n))
    row("  torch._C._cuda_getCurrentRawStream", lambda: raw_stream(idx))
    row("  torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
    ev = torch.cuda.Event()
    ev.record()
    row("  Event.query", ev.query)
    row("  Event.record(current_stream)", lambda: ev.record(torch.cuda.current_stream(dev)))
    row("  torch.empty(58, int32, cuda)", lambda: torch.empty(58, dtype=torch.int32, device=dev))
    row("  torch.empty((1024, 512), bf16, cuda)", lambda: torch.empty((1024, 512), dtype=torch.bfloat16, device=dev))
    row("  dbuf[:58] (a slice)", lambda: dbuf[:n])
    row("  dbuf.narrow(0, 0, 58)", lambda: dbuf.narrow(0, 0, n))
    row("  torch.cuda.current_device()", torch.cuda.current_device)
    row("  torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    err, rev = cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming)
    row("  cudaEventRecord (cuda.bindings)", lambda: cudart.cudaEventRecord(rev, raw_stream(idx)))
    row("  cudaEventQuery (cuda.bindings)", lambda: cudart.cudaEventQuery(rev))
    row("  torch.empty(2 * 2048, int64) + two slices",
        lambda: (lambda b: (b[:2048], b[2048:]))(torch.empty(4096, dtype=torch.int64, device=dev)))
    row("  two torch.empty(2048, int64)", lambda: (torch.empty(2048, dtype=torch.int64, device=dev),
                                                   torch.empty(2048, dtype=torch.int64, device=dev)))
    pageable(dev, values, dbuf, cudart, kind, raw_stream, idx)


def pageable(dev, values, dbuf, cudart, kind, raw_stream, idx):
    """cudaMemcpyAsync straight from a pageable host list, no pinned buffer and no event:
    its host time back to back and behind queued GPU work (a wait would show as the
    spin's length), and whether the values it copies are those at the call (the driver
    staged them) or at the copy (overwritten in between)."""
    n = len(values)

    def copy(arr):
        err, = cudart.cudaMemcpyAsync(dbuf.data_ptr(), arr.buffer_info()[0], 4 * len(arr),
                                      kind, raw_stream(idx))
        assert err == cudart.cudaError_t.cudaSuccess, err

    row("array + cudaMemcpyAsync from pageable memory", lambda: copy(array.array("i", values)))
    import time

    for spin_ms in (0, 5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(spin_ms * 1.5e6))  # about 1.5 GHz: roughly spin_ms of GPU work
        arr = array.array("i", values)
        t0 = time.perf_counter()
        copy(arr)
        host = (time.perf_counter() - t0) * 1e6
        for i in range(n):
            arr[i] = -1  # after the call: the copy must not see these
        torch.cuda.synchronize()
        seen = dbuf[:n].tolist()
        print(f"  behind a {spin_ms} ms spin: the call {host:8.1f} µs of host time, copied "
              f"{'the values at the call' if seen == values else 'values written after it'}",
              flush=True)


def launches(dev):
    B, S, D, r, coff = 8, 4096, 512, 4, 2
    W = coff * D
    kv = torch.randn(B * S, W, device=dev).bfloat16()
    sc = torch.randn(B * S, W, device=dev).bfloat16()
    ape = torch.randn(r, W, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * S
    cuc = torch.arange(B + 1, dtype=torch.int32, device=dev) * (S // r)
    N = B * S // r
    out = torch.empty((N, D), dtype=kv.dtype, device=dev)

    def problem():
        return Problem(kv, sc, ape, cu, cuc, N, r, coff, D, offsets_built=True)

    row("Problem(...) (offsets built)", problem)
    p = problem()
    row("launch_forward(problem, out) (spec, cache lookup, launch)", lambda: launch_forward(p, out))
    from csa_compressor.kernels import plan
    from csa_compressor.kernels.compile import compiled_for
    from csa_compressor.kernels.hardware import sm_count

    s = plan.spec("fwd", kv.dtype, r, coff, D)
    row("  plan.spec (memo)", lambda: plan.spec("fwd", kv.dtype, r, coff, D))
    row("  compiled_for (cache)", lambda: compiled_for(s, dev))
    c = compiled_for(s, dev)
    sm = sm_count(dev.index or 0)
    rows = c.kernel.rows_per_thread(N, sm, c.ctas_per_sm, None)
    row("  rows_per_thread", lambda: c.kernel.rows_per_thread(N, sm, c.ctas_per_sm, None))
    row("  the compiled pooling's launch alone (7 arguments)",
        lambda: c.fn(kv, sc, ape, cu, cuc, out, rows))
    st = streaming.StreamState(B, D, ratio=r, coff=coff, device=dev)
    cu_host, slots = cu.tolist(), list(range(B))
    streaming.prefill(st, kv, sc, ape, cu_host, slots)
    fn = st.constants["prefill_tail"]
    meta = torch.zeros((B, 5), dtype=torch.int32, device=dev)  # zero new tokens: no copies
    pos = torch.empty((2, N), dtype=torch.int64, device=dev)
    rings = st.flat_rings()
    row("the compiled tail's launch alone (11 arguments, no tokens)",
        lambda: fn(kv, sc, *rings, meta, st.count, st.last_n, pos[0], pos[1], st.history))
    row("prefill into empty slots (reset outside the timing)",
        lambda: (st.count.zero_(), st.set_host_counts(slots, [0] * B),
                 streaming.prefill(st, kv, sc, ape, cu_host, slots)))
    row("  of which the two reset calls", lambda: (st.count.zero_(),
                                                     st.set_host_counts(slots, [0] * B)))


def python_pieces(dev):
    """The Python steps of a prefill into 8 empty slots before and around its launches."""
    from csa_compressor.streaming import chunks, ring, rows

    B, S, D, r, coff = 8, 4096, 512, 4, 2
    kv = torch.randn(B * S, coff * D, device=dev).bfloat16()
    ape = torch.randn(r, coff * D, device=dev)
    st = streaming.StreamState(B, D, ratio=r, coff=coff, device=dev)
    cu, slots = [b * S for b in range(B + 1)], list(range(B))
    lens = [S] * B
    row("chunks._inputs (kv, score, offsets, slots)", lambda: chunks._inputs(st, kv, kv, cu, slots))
    row("StreamState.counts_of", lambda: st.counts_of(slots))
    row("chunks._check_room", lambda: chunks._check_room(st, slots, [0] * B, lens, None))
    row("rows.settings (the kept verdict)", lambda: rows.settings(
        st, kv, kv, ape, "fp32", None, None, None, "auto"))
    row("ring.tail_launcher (kept)", lambda: ring.tail_launcher(st, kv, kv))
    row("ring.tail_meta", lambda: ring.tail_meta(slots, cu, lens, (0 for _ in lens),
                                                  [S // r] * B))
    row("torch.is_grad_enabled + requires_grad x3", lambda: torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (kv, kv, ape)))


def main():
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{'piece':64s} {'host µs':>8s}")
    uploads(dev)
    launches(dev)
    python_pieces(dev)


main()
