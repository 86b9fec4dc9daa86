"""The kernels of each specialisation: lower() turns a plan.KernelSpec into the Units compiled
with it (a backward brings its dape sums and its large-pack variant), each a kernel object
(its launch design) and the symbolic arguments it compiles for."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from .dape_reduce import DapeReduce
from .epilogue_rows import cos_sin_vec, dtypes, supported
from .plan import (EpilogueKey, KernelSpec, Tuning, Unit, _fake, current, cutlass_dtype,
                   decode_designable, family)
from .pool_bwd import PoolBackward
from .pool_epilogue import (LongPoolEpilogueBackward, LongPoolEpilogueForward, PoolEpilogueBackward,
                            PoolEpilogueForward)
from .pool_decode import PoolDecode
from .pool_fwd import PoolForward
from .pool_long import LongPoolBackward, LongPoolForward


def lower(s: KernelSpec, arch_major: int) -> tuple:
    """The Units compiled for ``s``, its own first (family() less the kernels this
    specialisation does not have)."""
    specs = family(s)
    args = [compile_args(f.direction, f.dtype, f.ratio, f.coff, f.head_dim, f.row_stride,
                         f.batch, f.epilogue, f.tuning, f.fp32_dscore) for f in specs]
    kernels = [kernel_for(f.direction, f.dtype, f.ratio, f.coff, f.head_dim, arch_major, f.tuning,
                          f.row_stride, f.batch, f.numerics, f.epilogue, f.ape) for f in specs]
    return tuple(Unit(f, k, a) for f, k, a in zip(specs, kernels, args) if k is not None)


def kernel_for(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
               arch_major: int, tuning, row_stride: int = 0, batch: int = 0,
               numerics: str = "fp32", epilogue: EpilogueKey | None = None, ape: bool = True):
    """The kernel object of one specialisation, None where it has none: windows of more
    than MAX_REG_SLOTS slots take the slot-parallel kernels, the rest the register-resident
    ones; ``bwd_large`` is the register-resident backward's large-pack variant, where the
    default has one; ``dape`` / ``dape_wide`` the two layouts of the backward's partial sum,
    the wide one where the partials have the columns for it. With an ``epilogue``: the
    register-resident kernels with it inside (pool_epilogue), None where the design does
    not take it (epilogue_designable). ``ape=False``: the kernel without a position bias
    (staging.WindowSlots.has_ape)."""
    k = _kernel_for(direction, dtype, ratio, coff, head_dim, arch_major, tuning, row_stride,
                    batch, numerics, epilogue)
    if k is not None and not ape and direction not in ("dape", "dape_wide"):
        k.has_ape = False  # read at trace time only: the design (registers, grid) is the same
    return k


def _kernel_for(direction, dtype, ratio, coff, head_dim, arch_major, tuning, row_stride, batch,
                numerics, epilogue):
    cdt, cols = cutlass_dtype(dtype), ratio * coff * head_dim
    long, wide = tuning.long_window(coff * ratio), tuning.dape_has_wide(cols)
    if direction in ("dape", "dape_wide"):
        if direction == "dape_wide" and not wide:
            return None
        return DapeReduce(cols, wide=direction == "dape_wide", tuning=tuning)
    if direction == "decode":
        if not decode_designable(dtype, ratio, coff, head_dim, tuning):
            return None
        return PoolDecode(cdt, ratio, coff, head_dim, arch_major, tuning=tuning, numerics=numerics)
    kw = dict(tuning=tuning, row_stride=row_stride, batch=batch, numerics=numerics)
    forward, backward = PoolForward, PoolBackward
    if long:
        forward, backward = LongPoolForward, LongPoolBackward
    if epilogue is not None:  # the kernels with the epilogue inside
        if not epilogue_designable(dtype, ratio, coff, head_dim, arch_major, tuning, row_stride,
                                   batch, numerics, epilogue):
            return None

        forward, backward = ((LongPoolEpilogueForward, LongPoolEpilogueBackward) if long
                             else (PoolEpilogueForward, PoolEpilogueBackward))
        kw["epilogue"] = epilogue
    if long:
        if direction == "fwd":
            return forward(cdt, ratio, coff, head_dim, **kw)
        return backward(cdt, ratio, coff, head_dim, **kw) if direction == "bwd" else None
    if direction == "fwd":
        return forward(cdt, ratio, coff, head_dim, arch_major, **kw)
    default = backward(cdt, ratio, coff, head_dim, arch_major, **kw)
    if direction == "bwd":
        return default
    return (backward(cdt, ratio, coff, head_dim, arch_major, large=True, **kw)
            if default.has_large_variant else None)


_DESIGNABLE: dict = {}


def epilogue_designable(dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
                        arch_major: int, tuning, row_stride: int = 0, batch: int = 0,
                        numerics: str = "fp32", epilogue: EpilogueKey | None = None) -> bool:
    """Whether the pooling kernels of this specialisation take the epilogue inside: whole
    warps, a geometry the row math covers (epilogue_rows.supported), and a row's columns
    where its epilogue can find them: a register-resident forward whose CTA holds whole
    rows, a backward whose column groups own whole lanes of the row math (a lane's
    channels in one group). Kept: asked on every launch."""
    key = (dtype, ratio, coff, head_dim, arch_major, tuning, row_stride, batch, numerics,
           epilogue)
    hit = _DESIGNABLE.get(key)
    if hit is None:
        hit = _designable(*key)
        _DESIGNABLE[key] = hit
    return hit


def _designable(dtype, ratio, coff, head_dim, arch_major, tuning, row_stride, batch, numerics,
                epilogue):

    if epilogue is None or epilogue.weight_dtype not in dtypes():
        return False
    if not supported(dtype, head_dim, epilogue.rope_dim, epilogue.interleaved, epilogue.rotate):
        return False
    cdt = cutlass_dtype(dtype)
    if tuning.long_window(coff * ratio):
        kw = dict(tuning=tuning, row_stride=row_stride, batch=batch, numerics=numerics)
        fwd = LongPoolForward(cdt, ratio, coff, head_dim, **kw)
        bwd = LongPoolBackward(cdt, ratio, coff, head_dim, **kw)
        return (fwd.threads % 32 == 0 and bwd.threads % 32 == 0
                and bwd.cols % (head_dim // 32) == 0)
    fwd = PoolForward(cdt, ratio, coff, head_dim, arch_major, tuning=tuning,
                      row_stride=row_stride, batch=batch, numerics=numerics)
    bwd = PoolBackward(cdt, ratio, coff, head_dim, arch_major, tuning=tuning,
                       row_stride=row_stride, batch=batch, numerics=numerics)
    return (fwd.col_groups == 1 and fwd.threads % 32 == 0 and bwd.threads % 32 == 0
            and 32 % bwd.col_groups == 0)


def compile_args(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
                 row_stride: int = 0, batch: int = 0, epilogue: EpilogueKey | None = None,
                 tuning: Tuning | None = None, fp32_dscore: bool = False) -> tuple:
    """Symbolic arguments of a direction's launch: token, row, batch and partial-row counts
    stay symbolic, so packs change without recompiling; ``row_stride`` (0: packed rows) is
    the token rows' static stride in kv, score, dkv and dscore; ``batch`` (SBHD) makes the
    output and grad_out rows ``batch * head_dim`` apart (sequence 0's view of them);
    ``fp32_dscore``: a backward's dscore is fp32 (the kernels store its element type)."""

    W = coff * head_dim
    T, N, B1, P = (cute.sym_int32() for _ in range(4))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if direction in ("dape", "dape_wide"):
        return (_fake(cutlass.Float32, (P, ratio * W), 16),
                _fake(cutlass.Float32, (1, ratio * W), 16), stream)
    cdt = cutlass_dtype(dtype)
    if direction == "decode":
        return _decode_args(cdt, ratio, W, head_dim, stream)

    def rows():  # kv, score, dkv, dscore
        if row_stride:
            return cute.runtime.make_fake_tensor(cdt, (T, W), (row_stride, 1), assumed_align=16)
        return _fake(cdt, (T, W), 16)

    def outs():  # output, grad_out
        if batch:
            return cute.runtime.make_fake_tensor(cdt, (N, head_dim), (batch * head_dim, 1),
                                                 assumed_align=16)
        return _fake(cdt, (N, head_dim), 16)

    kv, score = rows(), rows()
    ape = _fake(cutlass.Float32, (ratio, W), 16)
    cu, cuc = _fake(cutlass.Int32, (B1,), 4), _fake(cutlass.Int32, (B1,), 4)
    long = (tuning or current()).long_window(coff * ratio)
    ep = () if epilogue is None else _epilogue_args(direction, cdt, head_dim, epilogue, long)
    if direction == "fwd":
        return (kv, score, ape, cu, cuc, outs(), Int32(1)) + ep + (stream,)
    grad = outs()
    dkv = rows()
    dscore = _fake(cutlass.Float32, (T, W), 16) if fp32_dscore else rows()
    work = _fake(cutlass.Float32, (P, W), 16)
    return (kv, score, ape, cu, cuc, grad, dkv, dscore, work, Int32(1), Int32(1),
            Int32(1)) + ep + (stream,)


def _epilogue_args(direction, cdt, head_dim, epilogue, long: bool):
    """The epilogue's symbolic arguments (pool_epilogue's launches): flat rows of the whole
    pack (``N * batch``), their statistics, the weight, the cosine and sine rows; the
    slot-parallel forward also the rows' counts."""


    NF, M = cute.sym_int32(), cute.sym_int32()
    cs = max(epilogue.rope_dim // 2, cos_sin_vec(head_dim, epilogue.interleaved))
    flat = lambda dt: _fake(dt, (NF, head_dim), 16)  # noqa: E731
    common = (_fake(cutlass.Float32, (NF, 1), 4), _fake(cutlass_dtype(epilogue.weight_dtype),
                                                        (head_dim,), 16),
              _fake(cutlass.Float32, (M, cs), 16), _fake(cutlass.Float32, (M, cs), 16))
    if direction == "fwd":  # pooled rows, statistics, weight, cos, sin, output (, counts)
        counts = (_fake(cutlass.Int32, (NF,), 4),) if long else ()
        return (flat(cdt),) + common + (flat(cdt),) + counts
    # output gradient, pooled rows, statistics, weight, cos, sin, rows gradient, products
    return (flat(cdt), flat(cdt)) + common + (flat(cdt), flat(cutlass.Float32))


def _decode_args(cdt, ratio: int, W: int, head_dim: int, stream) -> tuple:
    """A decode step's symbolic arguments (PoolDecode): the rings ``(slots * history, W)``,
    the new tokens ``(entries * next_n, W)``, the APE, the entries' slots, the slots'
    counts, last steps and bad flags, the rows (padded for the epilogue), their emitted
    flags (the entries' rows only) and positions; next_n, history and the position limit."""
    ring, new, entries, slots, rows, emitted = (cute.sym_int32() for _ in range(6))
    return (_fake(cdt, (ring, W), 16), _fake(cdt, (ring, W), 16), _fake(cdt, (new, W), 16),
            _fake(cdt, (new, W), 16), _fake(cutlass.Float32, (ratio, W), 16),
            _fake(cutlass.Int64, (entries,), 8), _fake(cutlass.Int64, (slots,), 8),
            _fake(cutlass.Int64, (slots,), 8), _fake(cutlass.Uint8, (slots,), 1),
            _fake(cdt, (rows, head_dim), 16), _fake(cutlass.Uint8, (emitted,), 1),
            _fake(cutlass.Int64, (rows,), 8), Int32(1), Int32(1), Int32(1), stream)
