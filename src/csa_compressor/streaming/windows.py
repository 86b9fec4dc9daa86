"""Which windows close in a streaming call, and the packs that compute them.

Row ``i`` of a sequence reads blocks ``i - 1`` (coff 2, ``i > 0``) and ``i``. A row whose
tokens all arrive in this call's chunk is computed in place over the chunk (the body);
a row that also needs tokens from the state (at most two a slot: the block the state
holds part of, and at coff 2 the block after it) is computed from a small gathered pack
(the boundary). Either way it is a row of a THD pack whose segment starts at a block
boundary of its sequence, which is what makes it the training op's row bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..softmax_order import ROWSUM_MIN_ROWS
from .uploads import device_ints

# torch's reduce order over a window depends on the row count for packs of fewer than 128
# output values (softmax_order.torch_sum_lanes_by_rows), and the epilogue's row sums below
# ROWSUM_MIN_ROWS rows: packs are padded past both, so a streamed row sums in the order of
# a training pack's.
_FEW_VALUES = 128


def min_rows(n: int, head_dim: int, epilogue: bool = False) -> int:
    """The capacity a pack of ``n`` rows is given (padding rows past the true ones)."""
    if not n:
        return 0
    return max(n, -(-_FEW_VALUES // head_dim), ROWSUM_MIN_ROWS if epilogue else 0)


@dataclass(slots=True)
class SlotWindows:  # (slots, not frozen: a frozen one took 2 µs to build)
    """One call slot's windows: blocks ``i0 .. i1 - 1`` close. The body computes blocks
    ``a .. i1 - 1`` in place over the chunk (its first row ``junk`` where that block's
    previous block is not in the segment); the boundary computes blocks ``j0 .. last``
    from a gathered segment of tokens ``t_lo .. t_hi - 1`` that starts ``shift`` blocks
    before ``j0`` (its first row then junk). ``start``: the chunk's first row in the
    caller's pack; ``c`` tokens seen before, ``n`` new."""

    c: int
    n: int
    start: int
    i0: int
    i1: int
    a: int
    head: int  # chunk tokens before block a (fewer than a block: they make no row)
    junk: int
    j0: int
    last: int
    shift: int
    # rows of the body and the boundary (fields, not properties: prefill reads them some
    # thirty times a call)
    body_rows: int
    bnd_rows: int


def plan(counts, lens, ratio: int, coff: int) -> list:
    """The SlotWindows of a prefill call, O(slots) on the host."""
    out, start = [], 0
    for c, n in zip(counts, lens):
        i0, i1 = c // ratio, (c + n) // ratio
        a = -(-c // ratio)  # the first block that starts inside the chunk
        junk = 1 if coff == 2 and a > 0 and i1 > a else 0
        last = min(a if coff == 2 and c > 0 else a - 1, i1 - 1)
        shift = 1 if coff == 2 and i0 > 0 else 0
        out.append(SlotWindows(c, n, start, i0, i1, a, min(a * ratio - c, n), junk, i0, last,
                               shift, max(i1 - a, 0), max(last - i0 + 1, 0)))
        start += n
    return out


# below this many indices a host list and one copy beat three device ops
HOST_INDEX_MAX = 512


def seg_list(starts, counts) -> list:
    """seg_arange's indices as a host list."""
    return [i for s, k in zip(starts, counts) for i in range(s, s + k)]


def seg_arange(starts, counts, device, staging=None) -> torch.Tensor:
    """``cat([arange(s, s + k) for s, k in zip(starts, counts)])`` from two small host
    lists, with no sync: built on the host where short, else on the device; the host list
    through ``staging`` (uploads.Staging) where given."""
    total = sum(counts)
    if not total:
        return torch.empty(0, dtype=torch.int64, device=device)
    if total <= HOST_INDEX_MAX:
        return device_ints(seg_list(starts, counts), device, staging=staging)
    offs, first = [], 0
    for s, k in zip(starts, counts):
        offs.append(s - first)
        first += k
    both = device_ints(list(counts) + offs, device, staging=staging)
    n = len(offs)
    return torch.arange(total, device=device) + torch.repeat_interleave(
        both[n:], both[:n], output_size=total)


def decode_geometry(count: torch.Tensor, n: int, ratio: int, coff: int):
    """Per slot of a decode step of ``n`` tokens (device tensors, no sync): the first block
    not yet emitted ``i0``, how many close ``m``, the row shift of its segment, and the
    static sizes: rows a slot may emit ``R``, segment tokens ``L`` and rows ``Rs``."""
    R = -(-n // ratio)
    i0 = count // ratio
    m = (count + n) // ratio - i0
    shift = (i0 > 0).to(torch.int64) if coff == 2 else torch.zeros_like(i0)
    Rs = R + coff - 1
    return i0, m, shift, R, Rs * ratio, Rs
