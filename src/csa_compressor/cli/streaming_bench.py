"""`csa-compressor bench --streaming`: prefill and decode of csa_compressor.streaming.

Prefill: 8 prompts of 4096 tokens into empty slots, emptied before each call outside its
timing (pooling "ring", with the tail kernel, and "fused", with torch ops), against the
training forward over the same tokens (compress_thd_fused) and the streaming plain-torch
path: wall time, CUDA events around each call (prefill reads its offsets on the host, so
it is timed outside graphs, and so is the training forward it is compared with), and GPU
time, each call enqueued behind a spin that hides its host time. Decode: one step of 256 slots in a CUDA graph of
20 steps, with and without the epilogue, the slots at staggered counts (slot ``b``
prefilled with ``coff*ratio + b % ratio`` tokens), so every step closes the windows of
``256 / ratio`` slots, as a server's slots at different lengths do: the one-launch kernel
(pooling "ring"; at ratio 128 the training op's pooling over the rings in place), the
gather path ("fused") and the plain-torch path, captured alike; the floor is the bytes
such a step must move (read the new tokens, write them into the state, read each closing
window, write every slot's row) over the copy bandwidth, and the launch floor one captured
elementwise kernel's time.
"""

from __future__ import annotations

import time

import torch

from .. import streaming
from ..epilogue import Epilogue
from ..ops import compress_thd_fused
from .bench import CALLS_PER_GRAPH, copy_bandwidth, time_graph, wall_clock

# (ratio, coff) at head_dim 512
RATIOS = ((4, 2), (128, 1))
PREFILL = (8, 4096)
DECODE_SLOTS = 256


# a queued spin this long holds the GPU while the host enqueues one call (checked per call)
_HOLD_US = 2000.0


def _spin_cycles(dev) -> int:
    """GPU clock cycles of torch.cuda._sleep that take some _HOLD_US µs."""
    torch.cuda._sleep(1_000_000)  # warm
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    per_us = 10_000_000 / (a.elapsed_time(b) * 1e3)
    return int(per_us * _HOLD_US)


def gpu_clock(call, setup, cycles: int, reps: int = 30) -> float:
    """µs of GPU time per call, host time hidden: the call is enqueued behind a spin of
    ``cycles``, events after the spin and after the call; a call whose host time outlasts
    the spin raises (the figure would hold host time)."""
    times = []
    for _ in range(reps + 3):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin = torch.cuda.Event(enable_timing=True)
        spin.record()
        torch.cuda._sleep(cycles)
        a.record()
        t0 = time.perf_counter()
        call()
        host = time.perf_counter() - t0
        b.record()
        b.synchronize()
        if host * 1e3 >= spin.elapsed_time(a):
            raise RuntimeError(f"the call's host time ({host * 1e6:.0f} µs) outlasted the spin")
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times[3:])[reps // 2]


def _prefill_row(ratio, coff, d, dtype, dev, progress, cycles):
    B, S = PREFILL
    W = coff * d
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(B * S, W, device=dev, generator=gen).to(dtype)
    sc = torch.randn(B * S, W, device=dev, generator=gen).to(dtype)
    ape = torch.randn(ratio, W, device=dev, generator=gen)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * S
    cuc = torch.arange(B + 1, dtype=torch.int32, device=dev) * (S // ratio)
    st = streaming.StreamState(B, d, ratio=ratio, coff=coff, dtype=dtype, device=dev)
    cu_host, slots = cu.tolist(), list(range(B))
    row = {"case": f"prefill {B}x{S} d{d} r{ratio}"}
    ways = {
        "training forward": lambda: compress_thd_fused(kv, sc, ape, cu, cuc, B * (S // ratio),
                                                       ratio=ratio, coff=coff),
        "streaming ring": lambda: streaming.prefill(st, kv, sc, ape, cu_host, slots,
                                                    pooling="ring"),
        "streaming fused": lambda: streaming.prefill(st, kv, sc, ape, cu_host, slots,
                                                     pooling="fused"),
        "streaming torch": lambda: streaming.prefill(st, kv, sc, ape, cu_host, slots,
                                                     pooling="reference"),
    }
    for name, call in ways.items():
        progress(f"{row['case']} {name} ...")
        # the slots emptied before each call, outside its events: prefill into empty slots
        setup = None if name == "training forward" else st.reset
        row[name] = _measured(lambda: wall_clock(call, setup=setup))
        if name != "streaming torch":
            row[f"{name} GPU"] = _measured(lambda: gpu_clock(call, setup, cycles))
    return row


def _measured(measure):
    """``measure()``, or the reason it failed as the cell's text (report, never hide)."""
    try:
        return measure()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def decode_floor_bytes(ratio, coff, d, elem, slots=DECODE_SLOTS) -> int:
    """A step of staggered slots: every slot's new token read and written to the state
    (kv and score) and its row written; ``slots / ratio`` windows of ``coff*ratio`` tokens
    of ``d`` channels read (kv and score)."""
    W = coff * d
    return slots * (2 * 2 * W * elem + d * elem) + slots // ratio * 2 * coff * ratio * d * elem


def staggered(st, gen):
    """Slot ``b`` of ``st`` prefilled with ``coff*ratio + b % ratio`` random tokens."""
    r, W = st.ratio, st.width
    lens = [st.coff * r + b % r for b in range(st.num_slots)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kv = torch.randn(cu[-1], W, device=st.device, generator=gen).to(st.dtype)
    sc = torch.randn(cu[-1], W, device=st.device, generator=gen).to(st.dtype)
    streaming.prefill(st, kv, sc, None, cu, list(range(st.num_slots)), emit=False)


def _decode_row(ratio, coff, d, dtype, dev, epilogue, bandwidth, progress):
    B, W = DECODE_SLOTS, coff * d
    gen = torch.Generator(device=dev).manual_seed(1)
    kv = torch.randn(B, 1, W, device=dev, generator=gen).to(dtype)
    sc = torch.randn(B, 1, W, device=dev, generator=gen).to(dtype)
    ape = torch.randn(ratio, W, device=dev, generator=gen)
    slots = torch.arange(B, device=dev)
    ep = Epilogue() if epilogue else None
    w = torch.rand(d, device=dev, generator=gen) + 0.5 if epilogue else None
    row = {"case": f"decode {B} slots d{d} r{ratio}" + (" +epilogue" if epilogue else "")}
    for name, pooling in (("streaming ring", "ring"), ("streaming fused", "fused"),
                          ("streaming torch", "reference")):
        st = streaming.StreamState(B, d, ratio=ratio, coff=coff, dtype=dtype, device=dev)
        staggered(st, gen)
        progress(f"{row['case']} {name} ...")
        try:
            row[name] = time_graph(lambda i: streaming.decode(st, kv, sc, ape, slots, epilogue=ep,
                                                              norm_weight=w, pooling=pooling), 1)
        except Exception as exc:  # report, never hide
            row[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    elem = torch.tensor([], dtype=dtype).element_size()
    row["floor"] = decode_floor_bytes(ratio, coff, d, elem) / bandwidth * 1e6
    return row


def launch_floor_us(dev) -> float:
    x = torch.zeros(1, device=dev)
    return time_graph(lambda i: x.add_(1), 1)


def run(dtype=torch.bfloat16, d=512, progress=print):
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    cycles = _spin_cycles(dev)
    rows = [_prefill_row(r, c, d, dtype, dev, progress, cycles) for r, c in RATIOS]
    rows += [_decode_row(r, c, d, dtype, dev, ep, bw, progress) for r, c in RATIOS
             for ep in (False, True)]
    return rows, {"copy_bandwidth_gbs": bw / 1e9, "launch_floor_us": launch_floor_us(dev)}


def table(rows, extra) -> str:
    names = ["training forward", "streaming ring", "streaming fused", "streaming torch", "floor"]
    lines = ["| case | " + " | ".join(f"{n} µs" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            v = r.get(n, "")
            cells.append(f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    gpu = ["training forward GPU", "streaming ring GPU", "streaming fused GPU"]
    if any(n in r for r in rows for n in gpu):
        lines += ["", "| prefill, GPU time | " + " | ".join(f"{n[:-4]} µs" for n in gpu) + " |",
                  "|---|" + "---|" * len(gpu)]
        for r in rows:
            if any(n in r for n in gpu):
                lines.append(f"| {r['case']} | " + " | ".join(
                    f"{r[n]:.1f}" if isinstance(r.get(n), float) else str(r.get(n, ""))
                    for n in gpu) + " |")
    lines.append("")
    lines.append(f"Prefill: CUDA events around each call (host time included); GPU time: the "
                 f"call enqueued behind a spin that outlasts its host time. Decode: µs per "
                 f"step, {CALLS_PER_GRAPH} steps per CUDA graph. Copy bandwidth {extra['copy_bandwidth_gbs']:.0f} GB/s; "
                 f"launch floor (one captured elementwise kernel) {extra['launch_floor_us']:.2f} µs.")
    return "\n".join(lines)


def header(env) -> str:
    return (f"GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env['torch']}, CuTe DSL "
            f"{env['cutlass_dsl']}, commit {env['commit']}, {env['date']}; bf16, head_dim 512")
