"""The one-launch paths of ``pooling="ring"``: decode's kernels/pool_decode reads the
slots' rings in place, so a step is one kernel (and the epilogue's) where the gather path
is some thirty small ones, its rows the training forward's (the forward's row math, in
its order); over aligned rings (long windows) kernels/decode_entries does a step's
bookkeeping in one launch and the training forward's kernel pools the closing windows
in place; prefill's kernels/prefill_tail stores the chunks into the rings and writes
the rows' slots and positions after its pooling, where torch ops took some fourteen, and
into empty slots kernels/prefill_offsets writes the pack's offsets from its launch
parameters before it, where a host copy took their values."""

from __future__ import annotations

import torch

from ..epilogue_op import apply_epilogue
from ..kernels.decode_entries import decode_entries
from ..kernels.launch import decode_kernel, launch_decode
from ..kernels.prefill_offsets import CAPACITIES, prefill_offsets
from ..kernels.prefill_tail import prefill_tail
from .rows import fused_problem, pool_rows, zero_ape
from .windows import min_rows


def _kernel_ready(*tensors) -> bool:
    """The tensors as the one-launch kernels read them: contiguous, 16-byte aligned."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def launcher(state, kv, score, ape, settings):
    """The compiled step for this call, or None where it takes the gather path: not the
    fused path (``settings``, rows.Settings), no entries, inputs not contiguous or not
    16-byte aligned, an APE the kernels cannot read, a window or row the kernel does not hold
    (plan.decode_designable), or no compiled kernel while a CUDA graph captures."""
    if not settings.fused or state.device.type != "cuda" or kv.shape[0] == 0:
        return None
    if not _kernel_ready(kv, score, *(() if ape is None else (ape,))):
        return None
    if ape is not None and (ape.dtype != torch.float32 or ape.device != state.device
                            or tuple(ape.shape) != (state.ratio, state.width)):
        return None
    return decode_kernel(state.device, state.dtype, state.ratio, state.coff, state.head_dim,
                         settings.numerics)


def step(c, state, kv, score, idx: torch.Tensor, settings):
    """Run compiled step ``c`` for entries ``idx`` (int64 slots on the device, unchecked:
    the kernel makes malformed entries NaN and their slots bad) with ``settings``'
    (rows.Settings) APE and epilogue. Returns (rows ``(B, R, head_dim)``, emitted ``(B,
    R)``, positions ``(B, R)``). With the epilogue the pooled rows take it by parts, as
    the training op's do where its kernels do not hold it: a pack padded past the norm's
    few-row orders (windows.min_rows), rows not emitted at position 0."""
    B, n, W = kv.shape
    R, d, dev = -(-n // state.ratio), state.head_dim, state.device
    # a zero APE adds what the no-APE kernels add (the guard's flag, 0)
    ape = zero_ape(state) if settings.ape is None else settings.ape
    ep = settings.epilogue
    cap = min_rows(B * R, d, True) if ep is not None else B * R
    # the kernel writes every row, the padding ones as zeros at position 0
    out = torch.empty((cap, d), dtype=state.dtype, device=dev)
    positions = torch.empty(cap, dtype=torch.int64, device=dev)
    emitted = torch.empty(B * R, dtype=torch.uint8, device=dev)
    launch_decode(c, state.flat_rings(),
                  (kv.view(B * n, W), score.view(B * n, W)), ape, idx.contiguous(),
                  (state.count, state.last_n, state.bad.view(torch.uint8)),
                  (out, emitted, positions), n, state.history, state.position_limit)
    if ep is not None:
        out = apply_epilogue(out, settings.norm_weight, positions, ep, settings.inv_freq,
                             rope_table=settings.rope_table)
    return (out[:B * R].view(B, R, d), emitted.view(torch.bool).view(B, R),
            positions[:B * R].view(B, R))


def tail_launcher(state, kv, score):
    """The prefill tail kernel for this call, or None where it cannot take it (then
    chunks._store and torch ops): not on a GPU, inputs not contiguous and 16-byte aligned,
    or no compiled kernel while a CUDA graph captures."""
    if state.device.type != "cuda" or not _kernel_ready(kv, score):
        return None
    fn = state.constants.get("prefill_tail")
    if fn is None:  # the compile cache's lookup cost some 10 µs of host time a call
        fn = prefill_tail(state.dtype, state.width, state.ratio, state.device)
        if fn is not None:
            state.constants["prefill_tail"] = fn
    return fn


# the tail kernel's ints a call slot (tail_meta)
META = 5


def tail_meta(slot_list, starts, lens, before, rows) -> list:
    """The tail kernel's int32 per call slot: (slot, first chunk row, new tokens, tokens
    before, first output row), flat; ``rows[b]`` rows for call slot ``b`` (any iterables,
    one item a call slot)."""
    meta, row0 = [], 0
    for s, start, n, c, k in zip(slot_list, starts, lens, before, rows):
        meta += (s, start, n, c, row0)
        row0 += k
    return meta


_PAD = (0,) * CAPACITIES[-1]


def offsets_launcher(state, slots: int):
    """``(kernel, capacity)`` of kernels/prefill_offsets for a call of ``slots`` slots,
    or None where it cannot take it (then the caller uploads the values): not on a GPU,
    more slots than the largest capacity, or no compiled kernel while a CUDA graph
    captures."""
    if state.device.type != "cuda":
        return None
    cap = next((c for c in CAPACITIES if c >= slots), None)
    if cap is None:
        return None
    key = ("prefill_offsets", cap)
    fn = state.constants.get(key)
    if fn is None:
        fn = prefill_offsets(cap, state.ratio, state.device)
        if fn is not None:
            state.constants[key] = fn
    return None if fn is None else (fn, cap)


def fresh_offsets(state, cu: list, slot_list: list):
    """A prefill into empty slots: its offsets ``cu``, its row offsets and tail_meta's
    ints (nothing before, a slot's rows its new tokens // ratio) on the device, written by
    one launch from its parameters into a scratch buffer of the state's staging, with no
    host copy: ``(cu, cuc, meta (slots, META))``, or None where the kernel cannot take the
    call (offsets_launcher; no scratch buffer free; capture, where the caller's plain copy
    is what a graph should hold). The offsets fit its int32 parameters: the fused path it
    serves checked ``T * width`` against int32 (rows.fused_problem)."""
    B = len(slot_list)
    if state.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    found = offsets_launcher(state, B)
    staging = state.staging() if found is not None else None
    got = staging.scratch(torch.int32, 2 * (B + 1) + META * B,
                          ((B + 1,), (B + 1,), (B, META))) if staging is not None else None
    if got is None:
        return None
    (fn, cap), (flat, parts) = found, got
    pad = _PAD[:cap - B]
    fn(flat, (*cu, *pad, *slot_list, *pad), B)
    return parts


def tail(fn, state, kv, score, slot_list: list, counts: list, meta: torch.Tensor, rows: int):
    """Run tail kernel ``fn`` after a prefill's pooling: its chunks' last tokens into the
    rings, the counts advanced (to ``counts``, a call slot's tokens seen after it); returns
    the ``rows`` rows' ``(slots, positions)``. ``meta``: tail_meta's values on the device,
    ``(call slots, META)``."""
    # never empty: an empty tensor may have no address to hand the kernel; one allocation,
    # two slices (unbind cost twice that, unpacking the tensor more)
    m = max(rows, 1)
    both = torch.empty(2 * m, dtype=torch.int64, device=state.device)
    slots, positions = both[:m], both[m:]
    fn(kv, score, *state.flat_rings(), meta, state.count, state.last_n,
       slots, positions, state.history)
    state.set_host_counts(slot_list, counts)
    return (slots, positions) if rows else (slots[:0], positions[:0])


def entries_launcher(state, kv, score):
    """The decode-entries kernel for a step over aligned rings (StreamState.aligned), or
    None where it cannot take it (then steps._in_place's torch ops): not on a GPU, inputs
    not contiguous and 16-byte aligned, or no compiled kernel while a CUDA graph captures."""
    if not state.aligned or state.device.type != "cuda" or not _kernel_ready(kv, score):
        return None
    return decode_entries(state.dtype, state.width, state.ratio, state.device)


def in_place(fn, state, kv, score, idx: torch.Tensor, settings, cap: int, cuc: torch.Tensor):
    """A decode step over aligned rings: kernel ``fn`` (entries_launcher) takes the
    entries (``idx``, int64 slots on the device, unchecked: malformed ones get bad slots
    and read the rings' NaN window, their rows NaN), then the training forward's pooling
    over the flat rings reads each closing window where it lies (``cuc``: one row a
    segment, ``cap`` rows: windows.min_rows).
    Returns (rows ``(B, 1, head_dim)``, emitted ``(B, 1)``, positions ``(B, 1)``)."""
    B, n, W = kv.shape
    dev = state.device
    rings = state.flat_rings()
    cu = torch.empty(B + 1, dtype=torch.int32, device=dev)
    emitted = torch.empty(B, dtype=torch.uint8, device=dev)
    positions = torch.empty(cap, dtype=torch.int64, device=dev)
    fn(kv.view(B * n, W), score.view(B * n, W), *rings, idx.contiguous(), state.count,
       state.last_n, state.bad.view(torch.uint8), cu, emitted, positions, n,
       state.history, state.position_limit, state.poison_row)
    out = pool_rings(state, settings, cu, cuc, cap,
                     positions if settings.epilogue is not None else None)[:B]
    return (out.view(B, 1, state.head_dim), emitted.view(torch.bool)[:, None],
            positions[:B, None])


def pool_rings(state, settings, cu, cuc, cap: int, positions) -> torch.Tensor:
    """rows.pool_rows over the flat rings as a token array (aligned rings: each closing
    window a segment whose row starts at ``cu``; -1 reads nothing), with the kernels'
    verdict kept for the state's tensor layout (rows.fused_problem), not validated each
    step."""
    rings = state.flat_rings()
    p = fused_problem(state, *rings, settings.ape)
    return pool_rows(settings if p is None else settings._replace(problem=p), *rings, cu, cuc,
                     cap, positions)
