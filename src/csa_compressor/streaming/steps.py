"""decode and take_back: a few tokens for each active slot, static shapes, no host sync
inside a CUDA-graph capture."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_int, check_tensor
from . import ring
from .rows import pool_rows, settings
from .state import check_state, host_list, which
from .windows import decode_geometry, min_rows


class Step(NamedTuple):
    """One decode step's rows, ``R = ceil(next_n / ratio)`` a slot: ``rows`` ``(B, R,
    head_dim)``, ``emitted`` ``(B, R)`` (whether the row's window closed in this step),
    ``positions`` ``(B, R)`` (``block_index * ratio``); rows and positions are meaningful
    where emitted (the paths differ elsewhere). Rows of a slot a captured step found
    malformed input for are NaN."""

    rows: torch.Tensor
    emitted: torch.Tensor
    positions: torch.Tensor


def _capturing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or (
        t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _require(state, ok: torch.Tensor, slots: torch.Tensor, message) -> None:
    """Eager: raise ``message(j)`` for the first entry ``j`` where ``ok`` is False (one
    sync). Under capture, where nothing can be read: mark those slots bad."""
    if _capturing(ok):
        hits = torch.zeros_like(state.count).index_add_(0, slots, (~ok).to(torch.int64))
        state.bad |= hits > 0
        return
    if not bool(ok.all()):
        raise ValueError(message(int((~ok).nonzero()[0])))


def _slots(state, slots, batch: int | None) -> torch.Tensor:
    """The step's slots on the device (None: all, in order), ``batch`` of them where
    given. Device-resident slots are checked on the device: eager, an error; under
    capture, entries out of range go to the spare slot and repeated slots go bad."""
    if slots is None:
        if batch is not None and batch != state.num_slots:
            raise ValueError(f"slots: needed when kv holds {batch} slots' tokens, not all "
                             f"{state.num_slots}")
        return torch.arange(state.num_slots, dtype=torch.int64, device=state.device)
    idx = state.slot_index(slots)
    if batch is not None and idx.numel() != batch:
        raise ValueError(f"slots: expected {batch} slots (kv's first dimension), got {idx.numel()}")
    if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
        inside = (idx >= 0) & (idx < state.num_slots)
        idx = torch.where(inside, idx, torch.full_like(idx, state.spare))
        _require(state, inside, idx,
                 lambda j: f"slots: the slot at index {j} is out of range [0, {state.num_slots})")
        once = torch.zeros_like(state.count).index_add_(0, idx, torch.ones_like(idx)) <= 1
        _require(state, once[idx] | (idx == state.spare), idx,
                 lambda j: f"slots: the slot at index {j} appears more than once in one step")
    return idx


def decode(state, kv, score, ape, slots=None, *, numerics: str = "fp32", epilogue=None,
           norm_weight=None, rope_table=None, pooling: str = "auto",
           epilogue_inside=None) -> Step:
    """Feed ``next_n`` tokens to each of ``B`` slots: ``kv`` / ``score`` ``(B, next_n,
    coff*head_dim)`` (next_n <= the state's max_next_n), ``slots`` ``(B,)`` (None: every
    slot, in order). Returns the step's rows with static shapes. Capturable in a CUDA
    graph (after one eager step of the same shapes has compiled the kernels); inside the
    capture, malformed slots cannot raise and make their rows NaN instead (state.bad).
    ``pooling="auto"`` (or "ring"): one kernel for the step where it takes it
    (streaming/ring.py), else the gather path. The other arguments: prefill's."""
    check_state(state)
    W = state.width
    for name, t in (("kv", kv), ("score", score)):
        check_tensor(name, t)
        if t.dim() != 3 or t.shape[2] != W:
            raise ValueError(f"{name}: expected (B, next_n, coff*head_dim = {W}), got {tuple(t.shape)}")
        if t.dtype != state.dtype or t.device != state.device:
            raise TypeError(f"{name}: expected the state's {state.dtype} on {state.device}, got "
                            f"{t.dtype} on {t.device}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected kv's shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    B, n = kv.shape[0], kv.shape[1]
    check_int("next_n (kv.shape[1])", n, 1, state.max_next_n)
    r, coff, d, H = state.ratio, state.coff, state.head_dim, state.history
    if rope_table is not None:
        last = None if state.max_seqlen is None else (state.max_seqlen // r - 1) * r
        rows_in_table = getattr(rope_table[0], "shape", (0,))[0] if isinstance(rope_table, (tuple, list)) else 0
        if last is None or last >= rows_in_table:
            raise ValueError(f"rope_table: decode needs StreamState(max_seqlen=...) whose last row "
                             f"position ({last}) lies inside the table's {rows_in_table} rows")
    capturing = _capturing(kv)
    c = _constants(state, B, n, epilogue is not None)
    ring_asked = pooling in ("auto", "ring")
    st = settings(state, kv.reshape(B * n, W), score.reshape(B * n, W), ape, numerics, epilogue,
                  norm_weight, rope_table, pooling, epilogue_inside)
    kernel = entries = None
    if ring_asked:
        kernel = ring.launcher(state, kv, score, ape, st)
        if kernel is None and st.fused:
            entries = ring.entries_launcher(state, kv, score)
    if (kernel is not None or entries is not None) and capturing and slots is not None:
        # unchecked: the kernels give malformed entries NaN rows and mark their slots bad
        idx = state.slot_index(slots)
        if idx.numel() != B:
            raise ValueError(f"slots: expected {B} slots (kv's first dimension), got {idx.numel()}")
    else:
        idx = _slots(state, slots, B)
    host_slots = list(range(B)) if slots is None else host_list(slots)
    if kernel is not None or entries is not None:
        if not capturing:
            _check_step(state, idx, n, False, host_slots)
        if kernel is not None:
            rows, emitted, positions = ring.step(kernel, state, kv, score, idx, st)
        else:
            rows, emitted, positions = ring.in_place(entries, state, kv, score, idx, st,
                                                     c["cap"], c["cuc"])
        state.follow(which(slots), lambda v: v + n, capturing)
        return Step(rows, emitted, positions)
    _check_step(state, idx, n, capturing, host_slots)
    if ring_asked and st.fused and state.aligned:
        return _in_place(state, kv, score, idx, st, c, capturing, which(slots))
    count = state.count[idx]
    # the new tokens into the rings, then each slot's segment gathered from its ring
    base = idx[:, None] * H
    dst = (base + (count[:, None] + c["k"]) % H).view(-1)
    ring_kv, ring_sc = state.flat_rings()
    ring_kv.index_copy_(0, dst, kv.reshape(-1, W))
    ring_sc.index_copy_(0, dst, score.reshape(-1, W))
    i0, m, shift, R, L, Rs = decode_geometry(count, n, r, coff)
    first = i0 - shift  # the segment's first block
    src = (base + (first[:, None] * r + c["L"]) % H).view(-1)
    pk = ring_kv.index_select(0, src)
    ps = ring_sc.index_select(0, src)
    pos = None
    if epilogue is not None:
        pos = (first[:, None] + c["j"]) * r
        if rope_table is not None:  # rows no one keeps may not point past the table
            real = (c["j"] >= shift[:, None]) & (c["j"] < (shift + m)[:, None])
            pos = torch.where(real, pos, torch.zeros_like(pos))
        pos = torch.cat([pos.view(-1), c["pad"]])
    out = pool_rows(st, pk, ps, c["cu"], c["cuc"], c["cap"], pos)[:B * Rs].view(B, Rs, d)
    if coff == 2:  # at a sequence's first block its row is the segment's first, else second
        out = out.gather(1, (shift[:, None] + c["R"])[:, :, None].expand(B, R, d))
    if capturing:  # eager calls raised above instead
        out = torch.where(state.bad[idx][:, None, None], torch.full_like(out, float("nan")), out)
    state.count.index_copy_(0, idx, count + n)
    state.last_n.index_fill_(0, idx, n)
    state.follow(which(slots), lambda v: v + n, capturing)
    return Step(out, c["R"] < m[:, None], (i0[:, None] + c["R"]) * r)


def _in_place(state, kv, score, idx, st, c, capturing: bool, known) -> Step:
    """A step of aligned rings (StreamState.aligned, coff 1) in torch ops, where
    ring.in_place's kernel cannot be had: the new tokens into the rings, then the training
    op's pooling over the flat rings, a segment a slot whose one row's window starts where
    the closing window lies in its ring (whole there), or where no window closes, outside
    the tokens, so the kernel reads nothing for it and writes zeros. The same kernel over
    the same tokens as the training forward: the same bits, reading only closing windows
    (the gather path copied every slot's window each step)."""
    B, n, W = kv.shape
    r, H, d = state.ratio, state.history, state.head_dim
    count = state.count[idx]
    base = idx * H
    ring_kv, ring_sc = state.flat_rings()
    dst = (base[:, None] + (count[:, None] + c["k"]) % H).view(-1)
    ring_kv.index_copy_(0, dst, kv.reshape(-1, W))
    ring_sc.index_copy_(0, dst, score.reshape(-1, W))
    emit = (count + n) // r > count // r  # n <= ratio: one window closes at most
    first = count // r * r  # the open window's first token, the closing one's where emit
    start = torch.where(emit, base + first % H, -1)
    if capturing:  # a bad slot's row pools the rings' NaN window (eager calls raised instead)
        start = torch.where(state.bad[idx], state.poison_row, start)
    cu = torch.cat([start, c["k"][:1] - 1]).to(torch.int32)
    pos = None
    if st.epilogue is not None:  # rows not emitted sit at position 0 (inside any table)
        pos = torch.cat([torch.where(emit, first, 0), c["pad"]])
    out = ring.pool_rings(state, st, cu, c["cuc"], c["cap"], pos)[:B].view(B, 1, d)
    state.count.index_copy_(0, idx, count + n)
    state.last_n.index_fill_(0, idx, n)
    state.follow(known, lambda v: v + n, capturing)
    return Step(out, emit[:, None], first[:, None])


def _check_step(state, idx, n: int, capturing: bool, host_slots=None) -> None:
    """The entries checked: eager, the errors decode raises; under capture, entries past
    the position limit make their slots bad. Eager with the slots and their counts on the
    host (``host_slots``, StreamState.host_counts) nothing is read from the device;
    otherwise one sync."""
    def past(j):
        return (f"kv: {n} new tokens take slot at index {j} past its capacity of "
                f"{state.position_limit} tokens")

    if not capturing and host_slots is not None and state.host_counts is not None:
        # a slot goes bad only where the host keeps no counts (a capture, a device
        # reorder, a loaded state)
        for j, s in enumerate(host_slots):
            if state.host_counts[s] + n > state.position_limit:
                raise ValueError(past(j))
        return
    if state.max_seqlen is not None:
        _require(state, state.count[idx] + n <= state.position_limit, idx, past)
    if not capturing and bool(state.bad[idx].any()):
        raise ValueError("slots: a slot met malformed input (its rows are NaN); reset it "
                         "before reuse")


def _constants(state, B: int, n: int, epilogue: bool) -> dict:
    """The step's shape-only tensors, made once per (B, next_n) and kept on the state."""
    key = (B, n, epilogue)
    got = state.constants.get(key)
    if got is None:
        r, coff, dev = state.ratio, state.coff, state.device
        R = -(-n // r)
        Rs = R + coff - 1
        cap = min_rows(B * Rs, state.head_dim, epilogue)
        seg = torch.arange(B + 1, dtype=torch.int32, device=dev)
        got = {"k": torch.arange(n, device=dev), "L": torch.arange(Rs * r, device=dev),
               "j": torch.arange(Rs, device=dev), "R": torch.arange(R, device=dev),
               "cu": seg * (Rs * r), "cuc": seg * Rs, "cap": cap,
               "pad": torch.zeros(cap - B * Rs, dtype=torch.int64, device=dev)}
        state.constants[key] = got
    return got


def take_back(state, k, slots=None) -> None:
    """Return the last ``k`` tokens of each slot's last decode step (``k``: an int, or a
    ``(B,)`` integer tensor, for ``slots`` as decode takes them), restoring the state as if
    they had never come. Rows already emitted from them are the caller's to discard.
    ``k`` beyond the last step's tokens is an error (under capture: the slot goes bad)."""
    check_state(state)
    idx = _slots(state, slots, None)
    host_k = [k] * idx.numel() if isinstance(k, int) and not isinstance(k, bool) else (
        host_list(k) if isinstance(k, torch.Tensor) else None)
    if isinstance(k, int) and not isinstance(k, bool):
        k = torch.full_like(idx, k)
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected an int or an integer tensor, got {type(k).__name__}")
    if k.dtype.is_floating_point or k.dtype == torch.bool or tuple(k.shape) != tuple(idx.shape):
        raise ValueError(f"k: expected an int or an integer tensor of shape {tuple(idx.shape)}, "
                         f"got {k.dtype} {tuple(k.shape)}")
    k = k.to(device=state.device, dtype=torch.int64)
    last = state.last_n[idx]
    _require(state, (k >= 0) & (k <= last), idx,
             lambda j: f"k: expected 0 or more tokens, got {int(k[j])} at index {j}" if k[j] < 0
             else f"k: {int(k[j])} tokens at index {j} is more than the {int(last[j])} of "
                  "that slot's last decode step")
    k = torch.minimum(k.clamp(min=0), last)
    state.count.index_copy_(0, idx, state.count[idx] - k)
    state.last_n.index_copy_(0, idx, last - k)
    # eager: every k was checked against its slot's last step above
    slots_known = which(slots) if host_k is not None else False
    back = iter(host_k or [])
    state.follow(slots_known, lambda v: v - next(back), _capturing(k))
