"""prefill: new chunks of tokens for some slots; the rows whose windows closed."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from ..checks import check_flag, check_tensor
from ..validation import check_token_offsets
from . import ring
from .rows import pool_kept, pool_rows, settings
from .state import check_state
from .uploads import device_ints
from .windows import HOST_INDEX_MAX, min_rows, plan, seg_arange, seg_list


class Rows(NamedTuple):
    """Rows emitted by a prefill call, in call order then block order: ``rows``
    ``(M, head_dim)``, the ``slots`` ``(M,)`` they belong to and their ``positions``
    ``(M,)`` (``block_index * ratio``, where the epilogue rotated them)."""

    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _inputs(state, kv, score, cu_seqlens, slots):
    check_state(state)
    W = state.width
    for name, t in (("kv", kv), ("score", score)):
        check_tensor(name, t)
        if t.dim() != 2 or t.shape[1] != W:
            raise ValueError(f"{name}: expected (T, coff*head_dim = {W}), got {tuple(t.shape)}")
        if t.dtype != state.dtype:
            raise TypeError(f"{name}: expected the state's dtype {state.dtype}, got {t.dtype}")
        # a CUDA tensor by its index alone: ``t.device`` builds an object every read
        if t.get_device() != state.device_index or not t.is_cuda and t.device != state.device:
            raise ValueError(f"{name}: expected the state's device {state.device}, got {t.device}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected kv's shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    # type(v) is int: ints and no bools, one call an item (other types go the tensor way)
    if isinstance(cu_seqlens, (list, tuple)) and cu_seqlens and all(
            type(v) is int for v in cu_seqlens):
        cu = list(cu_seqlens)
    else:
        if isinstance(cu_seqlens, (list, tuple)):
            if any(isinstance(v, (bool, float)) or not hasattr(v, "__index__")
                   for v in cu_seqlens):  # torch.tensor would round 8.5 to 8
                raise TypeError(f"cu_seqlens: expected integer offsets, got {list(cu_seqlens)!r}")
            cu_seqlens = torch.tensor([operator.index(v) for v in cu_seqlens], dtype=torch.int64)
        check_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 \
                or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor of B+1 offsets, "
                             f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        # prefill reads its offsets: one sync where they live on the GPU
        cu = cu_seqlens.to(device="cpu", dtype=torch.int64).tolist()
    check_token_offsets(cu, kv.shape[0])
    if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
        slots = slots.cpu()  # prefill reads its slots: one sync where they live on the GPU
    got = state.host_slots(slots)  # type, range and duplicates, on the host
    if len(got) != len(cu) - 1:
        raise ValueError(f"slots: expected one slot per sequence of cu_seqlens ({len(cu) - 1}), "
                         f"got {len(got)}")
    return cu, got


def prefill(state, kv, score, ape, cu_seqlens, slots, *, numerics: str = "fp32", epilogue=None,
            norm_weight=None, rope_table=None, pooling: str = "auto",
            epilogue_inside=None, emit: bool = True) -> Rows:
    """Feed each slot in ``slots`` its chunk of new tokens (sequence ``b`` of the THD pack
    ``kv`` / ``score`` ``(T, coff*head_dim)`` at ``cu_seqlens[b]:cu_seqlens[b+1]``) and
    return every row whose window closed. A slot may already hold part of a window from
    an earlier call; a prompt cut anywhere, in any number of calls, gives the same rows.
    ``ape``, ``numerics``, ``epilogue``, ``norm_weight``, ``rope_table``,
    ``epilogue_inside``: as compress_thd_fused's; ``pooling``: "fused" (the kernels, the
    rings stored by torch ops), "reference" (plain torch, any device) or "auto" (fused
    where the kernels take the inputs, the rings stored by one kernel; "ring" is the
    same). Reads the offsets and slots on the
    host, the counts from the state's host record where it has one (StreamState.counts_of;
    else one sync). ``emit=False`` only takes the
    tokens into the state (for a caller that computed these rows another way, e.g. the
    training op over whole sequences): no pooling, empty ``Rows``."""
    cu, slot_list = _inputs(state, kv, score, cu_seqlens, slots)
    counts = state.counts_of(slot_list)
    lens = [cu[b + 1] - cu[b] for b in range(len(slot_list))]
    dev = state.device
    if not check_flag("emit", emit):
        _check_room(state, slot_list, counts, lens, rope_table)
        _store(state, kv, score, slot_list, plan(counts, lens, state.ratio, state.coff))
        none = torch.empty(0, dtype=torch.int64, device=dev)
        return Rows(kv.new_empty((0, state.head_dim)), none, none)
    st = settings(state, kv, score, ape, numerics, epilogue, norm_weight, rope_table, pooling,
                  epilogue_inside)
    r, d = state.ratio, state.head_dim
    fn = ring.tail_launcher(state, kv, score) if pooling in ("auto", "ring") and st.fused \
        and slot_list else None
    if fn is not None and epilogue is None and not any(counts) and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (kv, score, ape))):
        return _fresh(state, st, fn, kv, score, cu, slot_list, lens)
    _check_room(state, slot_list, counts, lens, rope_table)
    staging = state.staging()
    wins = plan(counts, lens, r, state.coff)
    m = [w.i1 - w.i0 for w in wins]
    # the tail kernel's per-slot ints ride with the body pass's offsets: one upload a call
    meta = ring.tail_meta(slot_list, (w.start for w in wins), (w.n for w in wins),
                          (w.c for w in wins), m) if fn is not None else []
    meta_dev = None
    want_pos = epilogue is not None
    parts, cap = [], 0  # pooled rows of the body pass then the boundary pass
    body_base = bnd_base = 0
    if any(w.body_rows for w in wins):
        cu_b, rows_b = [0], []
        for w in wins:  # [head][blocks a .. i1-1][tail]: rows only in the middle
            cu_b += [cu_b[-1] + w.head, cu_b[-1] + w.head + w.body_rows * r, w.start + w.n]
            rows_b += [0, w.body_rows, 0]
        pooled, meta_dev = _pool(st, kv, score, cu_b, rows_b, d, want_pos,
                                 [w.a for w in wins], [w.body_rows for w in wins], meta,
                                 staging)
        parts.append(pooled)
        cap = parts[-1].shape[0]
    bnd = [w for w in wins if w.bnd_rows]
    if bnd:
        pk, ps, cu_d, rows_d = _boundary_pack(state, kv, score, bnd, slot_list, wins)
        parts.append(_pool(st, pk, ps, cu_d, rows_d, d, want_pos,
                           [w.j0 - w.shift for w in bnd], [w.shift + w.bnd_rows for w in bnd],
                           staging=staging)[0])
        bnd_base = cap
    total = sum(m)
    if not bnd and not any(w.junk for w in wins):
        out = parts[0][:total] if parts else kv.new_empty((0, d))  # in call order already
    else:
        # per slot its boundary rows, then its body rows past the junk one
        starts, counts, b_row, d_row = [], [], body_base, 0
        for w in wins:
            if w.bnd_rows:
                starts.append(bnd_base + d_row + w.shift)
                counts.append(w.bnd_rows)
                d_row += w.shift + w.bnd_rows
            starts.append(b_row + w.junk)
            counts.append(w.body_rows - w.junk)
            b_row += w.body_rows
        pooled = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = pooled.index_select(0, seg_arange(starts, counts, dev, staging))
    if fn is not None:
        if meta_dev is None:
            meta_dev = device_ints(meta, dev, torch.int32, staging)
        return Rows(out, *ring.tail(fn, state, kv, score, slot_list, [w.c + w.n for w in wins],
                                    meta_dev.view(-1, ring.META), total))
    _store(state, kv, score, slot_list, wins)
    B = len(slot_list)
    slots_m = device_ints(slot_list + m, dev, staging=staging)
    return Rows(out, torch.repeat_interleave(slots_m[:B], slots_m[B:], output_size=total),
                seg_arange([w.i0 for w in wins], m, dev, staging) * r)


def _check_room(state, slot_list, counts, lens, rope_table) -> None:
    """Each slot's new tokens within its capacity (and the rotary table's rows): before
    anything writes to the state (counts_of refused bad slots)."""
    limit = state.position_limit
    for b, s in enumerate(slot_list):
        if counts[b] + lens[b] > limit:
            raise ValueError(f"kv: {lens[b]} new tokens take slot {s} past its capacity of "
                             f"{limit} tokens (it holds {counts[b]})")
    if rope_table is not None and isinstance(rope_table, (tuple, list)) and lens:
        rows_in_table = getattr(rope_table[0], "shape", (0,))[0]
        last = max((counts[b] + lens[b]) // state.ratio for b in range(len(lens))) - 1
        if last * state.ratio >= rows_in_table:
            raise ValueError(f"rope_table: row position {last * state.ratio} is past the table's "
                             f"{rows_in_table} rows")


def _fresh(state, st, fn, kv, score, cu, slot_list, lens) -> Rows:
    """A call whose slots all start empty (a prompt's first chunk), on the kernels, with
    no epilogue and no gradient: its rows are the training op's over the chunks as they
    are (a segment a slot, the caller's offsets), so one launch writes the offsets and
    the tail kernel's ints from its parameters (ring.fresh_offsets; else one upload
    carries them), then the pooling and the tail launch, with no window plan."""
    r, k = state.ratio, len(cu)
    rows = [n // r for n in lens]
    total = sum(rows)
    got = ring.fresh_offsets(state, cu, slot_list)
    if got is None:
        cuc = [0]
        for m in rows:
            cuc.append(cuc[-1] + m)
        meta = ring.tail_meta(slot_list, cu, lens, (0 for _ in lens), rows)  # nothing before
        got = device_ints(cu + cuc + meta, state.device, torch.int32, state.staging(),
                          scratch=True, shapes=((k,), (k,), (k - 1, ring.META)))
    cu_d, cuc_d, meta_d = got
    n = min_rows(total, state.head_dim)
    out = pool_kept(state, st, cu_d, cuc_d, n)
    # checked once the pooling is queued (its host time then overlaps the GPU's): the
    # pooling writes only its own output, the tail is what writes the state
    _check_room(state, slot_list, [0] * len(lens), lens, None)
    return Rows(out if n == total else out[:total],
                *ring.tail(fn, state, kv, score, slot_list, lens, meta_d, total))


def _pool(st, kv, score, cu, rows, d, want_pos, first_blocks, block_counts, extra=(),
          staging=None):
    """The rows of a pack (offsets ``cu``, ``rows`` a segment), its capacity padded
    (windows.min_rows); the rotary positions where the epilogue takes them. ``extra``:
    int32 values uploaded with the offsets (through ``staging``, uploads.Staging), returned
    on the device (None where empty)."""
    dev = kv.device
    cuc = [0]
    for k in rows:
        cuc.append(cuc[-1] + k)
    n = min_rows(cuc[-1], d, want_pos)
    pos = None
    if want_pos:
        pos = seg_arange(first_blocks, block_counts, dev, staging) * st.ratio
        pos = torch.cat([pos, pos.new_zeros(n - pos.shape[0])])
    k = len(cu)
    offs = device_ints(cu + cuc + list(extra), dev, torch.int32, staging)
    rows_out = pool_rows(st, kv, score, offs[:k], offs[k:2 * k], n, pos)
    return rows_out, (offs[2 * k:] if extra else None)


def _boundary_pack(state, kv, score, bnd, slot_list, wins):
    """The boundary pack: per slot with boundary rows, tokens ``t_lo .. t_hi - 1`` (those
    before ``c`` from the slot's ring, the rest from its chunk); its offsets and rows."""
    H, W, r, dev = state.history, state.width, state.ratio, state.device
    slot_of = {id(w): slot_list[b] for b, w in enumerate(wins)}
    cu, rows, ring, chunk = [0], [], ([], [], [], []), ([], [], [])
    for w in bnd:
        t_lo, t_hi = (w.j0 - w.shift) * r, (w.last + 1) * r
        k_ring, k_chunk = w.c - t_lo, t_hi - w.c
        ring[0].append(cu[-1]), ring[1].append(k_ring), ring[2].append(t_lo)
        ring[3].append(slot_of[id(w)] * H)
        chunk[0].append(cu[-1] + k_ring), chunk[1].append(k_chunk), chunk[2].append(w.start)
        cu.append(cu[-1] + t_hi - t_lo)
        rows.append(w.shift + w.bnd_rows)
    staging = state.staging()
    base_k = device_ints(ring[3] + ring[1], dev, staging=staging)
    ring_src = seg_arange(ring[2], ring[1], dev, staging) % H + torch.repeat_interleave(
        base_k[:len(bnd)], base_k[len(bnd):], output_size=sum(ring[1]))
    ring_dst = seg_arange(ring[0], ring[1], dev, staging)
    chunk_src = seg_arange(chunk[2], chunk[1], dev, staging)
    chunk_dst = seg_arange(chunk[0], chunk[1], dev, staging)
    packs = []
    for held, new in zip(state.flat_rings(), (kv, score)):
        pack = new.new_empty((cu[-1], W))
        pack.index_copy_(0, ring_dst, held.index_select(0, ring_src))
        pack.index_copy_(0, chunk_dst, new.index_select(0, chunk_src))
        packs.append(pack)
    return packs[0], packs[1], cu, rows


def _store(state, kv, score, slot_list, wins):
    """The chunks' last ``history`` tokens into the slots' rings; the counts advanced."""
    H, dev, staging = state.history, state.device, state.staging()
    keep = [min(w.n, H) for w in wins]
    new = [w.c + w.n for w in wins]
    m, B = sum(keep), len(slot_list)
    if m <= HOST_INDEX_MAX:  # every index in one host list, one copy
        src = seg_list([w.start + w.n - k for w, k in zip(wins, keep)], keep)
        dst = [s * H + t % H for w, k, s in zip(wins, keep, slot_list)
               for t in range(w.c + w.n - k, w.c + w.n)]
        ix = device_ints(src + dst + slot_list + new, dev, staging=staging)
        src, dst, idx, counts = ix[:m], ix[m:2 * m], ix[2 * m:2 * m + B], ix[2 * m + B:]
    else:
        src = seg_arange([w.start + w.n - k for w, k in zip(wins, keep)], keep, dev, staging)
        ix = device_ints(slot_list + new + [s * H for s in slot_list] + keep, dev, staging=staging)
        idx, counts = ix[:B], ix[B:2 * B]
        dst = seg_arange([w.c + w.n - k for w, k in zip(wins, keep)], keep, dev, staging) % H + \
            torch.repeat_interleave(ix[2 * B:3 * B], ix[3 * B:], output_size=m)
    if m:
        for held, new_rows in zip(state.flat_rings(), (kv, score)):
            held.index_copy_(0, dst, new_rows.index_select(0, src))
    state.count[idx] = counts
    state.last_n.index_fill_(0, idx, 0)  # t[idx] = 0 would copy the 0 to the device, a sync
    state.set_host_counts(slot_list, new)
