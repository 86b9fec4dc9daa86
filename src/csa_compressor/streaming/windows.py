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

# torch's reduce order over a window depends on the row count for packs of fewer than 128
# output values (softmax_order.torch_sum_lanes_by_rows): packs are padded past that, so
# a streamed row sums in the order of a training pack's.
_FEW_VALUES = 128


def min_rows(n: int, head_dim: int) -> int:
    """The capacity a pack of ``n`` rows is given (padding rows past the true ones)."""
    return max(n, -(-_FEW_VALUES // head_dim)) if n else 0


@dataclass
class Pack:
    """A THD pack to pool: token rows (``None``: the caller's chunk in place) or gather
    indices, host offsets, and per row its rotary position and whether it is kept."""

    cu: list
    positions: list
    keep: list  # per row: index into the call's output, or -1
    src: list | None = None  # per token: (0, b, t) token t of call slot b's ring, (1, row) the chunk's


def prefill_packs(counts, lens, ratio: int, coff: int):
    """The body and boundary packs of a prefill call. ``counts``: tokens each slot has
    seen; ``lens``: its new tokens. Returns (body, boundary, per call row: (b, block))."""
    r = ratio
    body = Pack(cu=[0], positions=[], keep=[])
    bnd = Pack(cu=[0], positions=[], keep=[], src=[])
    rows = []
    start = 0  # the chunk's first token in the caller's pack
    for b, (c, n) in enumerate(zip(counts, lens)):
        i0, i1 = c // r, (c + n) // r
        a = -(-c // r)  # the first block that starts inside the chunk
        first_row = len(rows)
        rows.extend((b, i) for i in range(i0, i1))
        # body: [head < r tokens][blocks a .. i1-1][tail < r tokens], rows only in the middle
        head = min(a * r - c, n)
        mid = max(i1 - a, 0) * r
        body.cu += [body.cu[-1] + head, body.cu[-1] + head + mid, start + n]
        for k, i in enumerate(range(a, i1)):
            junk = coff == 2 and a > 0 and k == 0  # its previous block is not in the segment
            body.positions.append(i * r)
            body.keep.append(-1 if junk else first_row + i - i0)
        # boundary: the rows that read tokens held by the state
        last = min(a if coff == 2 and c > 0 else a - 1, i1 - 1)
        if i0 <= last:
            shift = 1 if coff == 2 and i0 > 0 else 0
            t_lo, t_hi = (i0 - shift) * r, (last + 1) * r
            bnd.src += [(0, b, t) if t < c else (1, start + t - c) for t in range(t_lo, t_hi)]
            bnd.cu.append(bnd.cu[-1] + t_hi - t_lo)
            for k in range(shift + last - i0 + 1):
                i = i0 - shift + k
                bnd.positions.append(i * r)
                bnd.keep.append(-1 if k < shift else first_row + i - i0)
        start += n
    return body, bnd, rows


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
