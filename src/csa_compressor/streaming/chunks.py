"""prefill: new chunks of tokens for some slots; the rows whose windows closed."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_tensor
from .rows import pool_rows, settings
from .windows import min_rows, prefill_packs


class Rows(NamedTuple):
    """Rows emitted by a prefill call, in call order then block order: ``rows``
    ``(M, head_dim)``, the ``slots`` ``(M,)`` they belong to and their ``positions``
    ``(M,)`` (``block_index * ratio``, where the epilogue rotated them)."""

    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _inputs(state, kv, score, cu_seqlens, slots):
    W = state.width
    for name, t in (("kv", kv), ("score", score)):
        check_tensor(name, t)
        if t.dim() != 2 or t.shape[1] != W:
            raise ValueError(f"{name}: expected (T, coff*head_dim = {W}), got {tuple(t.shape)}")
        if t.dtype != state.dtype:
            raise TypeError(f"{name}: expected the state's dtype {state.dtype}, got {t.dtype}")
        if t.device != state.device:
            raise ValueError(f"{name}: expected the state's device {state.device}, got {t.device}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected kv's shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    if isinstance(cu_seqlens, (list, tuple)):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    check_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor of B+1 offsets, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()  # prefill reads its offsets: one sync where they live on the GPU
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {cu[0]}")
    for s in range(len(cu) - 1):
        if cu[s + 1] < cu[s]:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{s}] = "
                             f"{cu[s]} > cu_seqlens[{s + 1}] = {cu[s + 1]}")
    if cu[-1] > kv.shape[0]:
        raise ValueError(f"cu_seqlens: the last offset {cu[-1]} is past the {kv.shape[0]} tokens of kv")
    if not isinstance(slots, torch.Tensor) or slots.device.type != "cpu":
        slots = torch.as_tensor(slots.tolist() if isinstance(slots, torch.Tensor) else slots)
    if slots.dim() != 1 or slots.numel() != len(cu) - 1:
        raise ValueError(f"slots: expected one slot per sequence of cu_seqlens ({len(cu) - 1}), "
                         f"got shape {tuple(slots.shape)}")
    state.slot_index(slots)  # range and duplicates, on the host
    return cu, slots.tolist()


def prefill(state, kv, score, ape, cu_seqlens, slots, *, numerics: str = "fp32", epilogue=None,
            norm_weight=None, rope_table=None, pooling: str = "auto", emit: bool = True) -> Rows:
    """Feed each slot in ``slots`` its chunk of new tokens (sequence ``b`` of the THD pack
    ``kv`` / ``score`` ``(T, coff*head_dim)`` at ``cu_seqlens[b]:cu_seqlens[b+1]``) and
    return every row whose window closed. A slot may already hold part of a window from
    an earlier call; a prompt cut anywhere, in any number of calls, gives the same rows.
    ``ape``, ``numerics``, ``epilogue``, ``norm_weight``, ``rope_table``: as
    compress_thd_fused's; ``pooling``: "fused", "reference" (plain torch, any device) or
    "auto" (fused where the kernels take the inputs). Reads the offsets and the slots'
    counts on the host (one sync where they live on the GPU). ``emit=False`` only takes the
    tokens into the state (for a caller that computed these rows another way, e.g. the
    training op over whole sequences): no pooling, empty ``Rows``."""
    cu, slot_list = _inputs(state, kv, score, cu_seqlens, slots)
    slots_dev = torch.tensor(slot_list, dtype=torch.int64, device=state.device)
    counts = state.count[slots_dev].tolist()
    bad = state.bad[slots_dev].tolist()
    lens = [cu[b + 1] - cu[b] for b in range(len(slot_list))]
    for b, s in enumerate(slot_list):
        if bad[b]:
            raise ValueError(f"slots: slot {s} met malformed input in a captured step (its rows "
                             "are NaN); reset it before reuse")
        if counts[b] + lens[b] > state.position_limit:
            raise ValueError(f"kv: {lens[b]} new tokens take slot {s} past its capacity of "
                             f"{state.position_limit} tokens (it holds {counts[b]})")
    if rope_table is not None and isinstance(rope_table, (tuple, list)) and lens:
        rows_in_table = getattr(rope_table[0], "shape", (0,))[0]
        last = max((counts[b] + lens[b]) // state.ratio for b in range(len(lens))) - 1
        if last * state.ratio >= rows_in_table:
            raise ValueError(f"rope_table: row position {last * state.ratio} is past the table's "
                             f"{rows_in_table} rows")
    dev = state.device
    if not emit:
        _store(state, kv, score, slot_list, counts, lens, cu)
        none = torch.empty(0, dtype=torch.int64, device=dev)
        return Rows(kv.new_empty((0, state.head_dim)), none, none)
    st = settings(state, kv, score, ape, numerics, epilogue, norm_weight, rope_table, pooling,
                  torch.tensor(cu, dtype=torch.int32, device=dev))
    body, bnd, rows = prefill_packs(counts, lens, state.ratio, state.coff)
    d = state.head_dim
    parts, keep = [], []
    if any(k >= 0 for k in body.keep):
        parts.append(_pool(st, kv, score, body, d))
        keep += body.keep + [-1] * (parts[-1].shape[0] - len(body.keep))
    if bnd.keep:
        pk, ps = _boundary_tokens(state, kv, score, bnd.src, slot_list)
        parts.append(_pool(st, pk, ps, bnd, d))
        keep += bnd.keep + [-1] * (parts[-1].shape[0] - len(bnd.keep))
    in_order = len(parts) == 1 and keep[:len(rows)] == list(range(len(rows)))
    if in_order:
        out = parts[0][:len(rows)]  # the body's rows are the call's: no copy
    else:
        out = torch.empty((len(rows), d), dtype=parts[0].dtype if parts else kv.dtype, device=dev)
    if parts and not in_order:
        pooled = torch.cat(parts) if len(parts) > 1 else parts[0]
        src = [j for j, k in enumerate(keep) if k >= 0]
        out.index_copy_(0, torch.tensor([keep[j] for j in src], dtype=torch.int64, device=dev),
                        pooled.index_select(0, torch.tensor(src, dtype=torch.int64, device=dev)))
    _store(state, kv, score, slot_list, counts, lens, cu)
    r = state.ratio
    return Rows(out, torch.tensor([slot_list[b] for b, _ in rows], dtype=torch.int64, device=dev),
                torch.tensor([i * r for _, i in rows], dtype=torch.int64, device=dev))


def _pool(st, kv, score, pack, d):
    """The pack's rows, its capacity padded (windows.min_rows)."""
    dev = kv.device
    r = st.ratio
    rows_per = [(pack.cu[j + 1] - pack.cu[j]) // r for j in range(len(pack.cu) - 1)]
    cuc = [0]
    for n in rows_per:
        cuc.append(cuc[-1] + n)
    n = min_rows(cuc[-1], d)
    pos = pack.positions + [0] * (n - len(pack.positions))
    return pool_rows(st, kv, score, torch.tensor(pack.cu, dtype=torch.int32, device=dev),
                     torch.tensor(cuc, dtype=torch.int32, device=dev), n,
                     torch.tensor(pos, dtype=torch.int64, device=dev))


def _boundary_tokens(state, kv, score, src, slot_list):
    """The boundary pack's ``kv`` and ``score`` rows: ring tokens ``(0, b, t)`` of slot
    ``slot_list[b]`` and chunk rows ``(1, row)``."""
    H, dev = state.history, state.device
    ring_at, ring_rows, chunk_at, chunk_rows = [], [], [], []
    for j, e in enumerate(src):
        if e[0] == 0:
            ring_at.append(j)
            ring_rows.append(slot_list[e[1]] * H + e[2] % H)
        else:
            chunk_at.append(j)
            chunk_rows.append(e[1])
    out = []
    for ring, chunk in ((state.kv, kv), (state.score, score)):
        pack = chunk.new_empty((len(src), state.width))
        for at, rows, t in ((ring_at, ring_rows, ring.view(-1, state.width)), (chunk_at, chunk_rows, chunk)):
            if at:
                at_t = torch.tensor(at, dtype=torch.int64, device=dev)
                pack.index_copy_(0, at_t, t.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev)))
        out.append(pack)
    return out


def _store(state, kv, score, slot_list, counts, lens, cu):
    """The chunks' last ``history`` tokens into the slots' rings; the counts advanced."""
    H, dev = state.history, state.device
    dst, src = [], []
    for b, s in enumerate(slot_list):
        c, n = counts[b], lens[b]
        for t in range(max(c, c + n - H), c + n):
            dst.append(s * H + t % H)
            src.append(cu[b] + t - c)
    if dst:
        d_t = torch.tensor(dst, dtype=torch.int64, device=dev)
        s_t = torch.tensor(src, dtype=torch.int64, device=dev)
        state.kv.view(-1, state.width).index_copy_(0, d_t, kv.index_select(0, s_t))
        state.score.view(-1, state.width).index_copy_(0, d_t, score.index_select(0, s_t))
    idx = torch.tensor(slot_list, dtype=torch.int64, device=dev)
    state.count[idx] = torch.tensor([c + n for c, n in zip(counts, lens)], dtype=torch.int64, device=dev)
    state.last_n[idx] = 0
