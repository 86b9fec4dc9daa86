"""Which kernels each specialisation is built from, and the symbolic arguments they compile
for. A specialisation is a frozen KernelSpec (direction, dtype, ratio, coff, head_dim and
the tuning's code-generating values): the compile cache's key with the device. lower()
turns one into the Units compiled with it (a backward brings its dape sums and its
large-pack variant); a Unit's kernel object is its launch design (vectors, lanes, stages,
register bound, grid target), built from the spec and the architecture alone. compile.py
compiles the Units and launch.py sizes each launch from the kernel and its registers."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..validation import POOL_NUMERICS as NUMERICS
from .tuning import Tuning, current

DIRECTIONS = ("fwd", "bwd", "bwd_large", "dape", "dape_wide")


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32}[dtype]


@dataclass(frozen=True)
class EpilogueKey:
    """What the pooling kernels with the epilogue inside (pool_epilogue) are compiled for:
    the rotary channels and their pair layout, the Hadamard rotation, the norm's eps and
    its weight's dtype."""

    rope_dim: int
    interleaved: bool
    rotate: bool
    eps: float
    weight_dtype: torch.dtype

    @classmethod
    def of(cls, ep, weight_dtype: torch.dtype) -> "EpilogueKey":
        """The key of an epilogue.Epilogue with a norm weight of ``weight_dtype``."""
        return cls(ep.rope_dim, bool(ep.rope_interleaved), bool(ep.rotate), float(ep.eps),
                   weight_dtype)

    def __str__(self):
        return (f"epilogue(rope_dim={self.rope_dim}, interleaved={self.interleaved}, "
                f"rotate={self.rotate}, eps={self.eps}, weight={self.weight_dtype})")


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation. ``tuning`` is the code-generating view (Tuning.codegen()), so
    a sweep's variant is another key and never reuses a stale kernel."""

    direction: str
    dtype: torch.dtype
    ratio: int
    coff: int
    head_dim: int
    tuning: Tuning
    # Elements between token rows of kv / score and of dkv / dscore; 0: packed rows of
    # coff * head_dim (kv and score column halves of one tensor: 2 * coff * head_dim).
    row_stride: int = 0
    # SBHD: this many sequences interleaved token by token, one a grid.z index (rows of a
    # sequence row_stride apart, output rows batch * head_dim apart); 0: a THD pack.
    batch: int = 0
    # "fp32": the pooling's fp32 region; "eager": the weights and products rounded to the
    # input dtype as Megatron-LM's eager region rounds them (ptx.rounder).
    numerics: str = "fp32"
    # The epilogue inside the kernels (pool_epilogue); None: the pooling alone.
    epilogue: EpilogueKey | None = None

    def __hash__(self):
        # Hashed on every launch (the compile cache's key): once, not over the tuning's fields
        # each time.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.direction, self.dtype, self.ratio, self.coff, self.head_dim, self.tuning,
                      self.row_stride, self.batch, self.numerics, self.epilogue))
            object.__setattr__(self, "_hash", h)
        return h

    def __str__(self):
        rows = f", row_stride={self.row_stride}" if self.row_stride else ""
        rows += f", batch={self.batch}" if self.batch else ""
        rows += f", numerics={self.numerics!r}" if self.numerics != "fp32" else ""
        rows += f", {self.epilogue}" if self.epilogue is not None else ""
        return (f"{self.direction} kernel for dtype={self.dtype}, ratio={self.ratio}, "
                f"coff={self.coff}, head_dim={self.head_dim}{rows}")


@dataclass(frozen=True)
class Unit:
    """One kernel to compile: its spec, its kernel object (the launch design, built from the
    spec and the architecture alone) and the symbolic arguments it compiles for."""

    spec: KernelSpec
    kernel: object
    args: tuple


_SPECS: dict = {}


def spec(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
         tuning: Tuning | None = None, row_stride: int = 0, batch: int = 0,
         numerics: str = "fp32", epilogue: EpilogueKey | None = None) -> KernelSpec:
    """The spec of one specialisation under ``tuning`` (default: the current one).

    Asked on every launch, so the answer is kept: deriving the tuning's code-generating view
    cost ~15 µs of host time. The memo keys on the tuning object and keeps it alive, so its
    id cannot be reused."""
    t = tuning or current()
    key = (direction, dtype, ratio, coff, head_dim, id(t), row_stride, batch, numerics, epilogue)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is t:
        return hit[1]
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
    if direction in ("dape", "dape_wide"):
        # the partials are fp32 whatever the inputs are, in one layout
        dtype, row_stride, batch, numerics, epilogue = torch.float32, 0, 0, "fp32", None
    if batch == 1:
        batch = 0  # one SBHD sequence is a one-segment pack
    if row_stride == coff * head_dim and not batch:
        row_stride = 0  # packed rows: one spec, one kernel
    made = KernelSpec(direction, dtype, ratio, coff, head_dim, t.codegen(), row_stride, batch,
                      numerics, epilogue)
    if len(_SPECS) > 4096:  # a sweep's many tunings: keep the memo small
        _SPECS.clear()
    _SPECS[key] = (t, made)
    return made


def family(s: KernelSpec) -> tuple:
    """``s`` and the specs compiled with it, ``s`` first: a backward's dape sums (both
    layouts) and a default backward's large-pack variant. kernel_for says which of them
    this specialisation has."""
    sums = tuple(replace(s, direction=d, dtype=torch.float32, row_stride=0, batch=0,
                         numerics="fp32", epilogue=None)
                 for d in ("dape", "dape_wide"))
    if s.direction == "bwd":
        return (s,) + sums + (replace(s, direction="bwd_large"),)
    if s.direction == "bwd_large":
        return (s,) + sums
    return (s,)


def lower(s: KernelSpec, arch_major: int) -> tuple:
    """The Units compiled for ``s``, its own first (family() less the kernels this
    specialisation does not have)."""
    specs = family(s)
    args = [compile_args(f.direction, f.dtype, f.ratio, f.coff, f.head_dim, f.row_stride,
                         f.batch, f.epilogue, f.tuning) for f in specs]
    kernels = [kernel_for(f.direction, f.dtype, f.ratio, f.coff, f.head_dim, arch_major, f.tuning,
                          f.row_stride, f.batch, f.numerics, f.epilogue) for f in specs]
    return tuple(Unit(f, k, a) for f, k, a in zip(specs, kernels, args) if k is not None)


def kernel_for(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
               arch_major: int, tuning, row_stride: int = 0, batch: int = 0,
               numerics: str = "fp32", epilogue: EpilogueKey | None = None):
    """The kernel object of one specialisation, None where it has none: windows of more
    than MAX_REG_SLOTS slots take the slot-parallel kernels, the rest the register-resident
    ones; ``bwd_large`` is the register-resident backward's large-pack variant, where the
    default has one; ``dape`` / ``dape_wide`` the two layouts of the backward's partial sum,
    the wide one where the partials have the columns for it. With an ``epilogue``: the
    register-resident kernels with it inside (pool_epilogue), None where the design does
    not take it (epilogue_designable)."""
    from .dape_reduce import DapeReduce
    from .pool_bwd import PoolBackward
    from .pool_fwd import PoolForward
    from .pool_long import LongPoolBackward, LongPoolForward

    cdt, cols = cutlass_dtype(dtype), ratio * coff * head_dim
    long, wide = tuning.long_window(coff * ratio), tuning.dape_has_wide(cols)
    if direction in ("dape", "dape_wide"):
        if direction == "dape_wide" and not wide:
            return None
        return DapeReduce(cols, wide=direction == "dape_wide", tuning=tuning)
    kw = dict(tuning=tuning, row_stride=row_stride, batch=batch, numerics=numerics)
    forward, backward = PoolForward, PoolBackward
    if long:
        forward, backward = LongPoolForward, LongPoolBackward
    if epilogue is not None:  # the kernels with the epilogue inside
        if not epilogue_designable(dtype, ratio, coff, head_dim, arch_major, tuning, row_stride,
                                   batch, numerics, epilogue):
            return None
        from . import pool_epilogue as pe

        forward, backward = ((pe.LongPoolEpilogueForward, pe.LongPoolEpilogueBackward) if long
                             else (pe.PoolEpilogueForward, pe.PoolEpilogueBackward))
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
    from .epilogue_rows import dtypes, supported
    from .pool_bwd import PoolBackward
    from .pool_fwd import PoolForward
    from .pool_long import LongPoolBackward, LongPoolForward

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


def _fake(dtype, shape, align):
    import cutlass.cute as cute

    order = tuple(range(len(shape)))[::-1]  # row-major
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def compile_args(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
                 row_stride: int = 0, batch: int = 0, epilogue: EpilogueKey | None = None,
                 tuning: Tuning | None = None) -> tuple:
    """Symbolic arguments of a direction's launch: token, row, batch and partial-row counts
    stay symbolic, so packs change without recompiling; ``row_stride`` (0: packed rows) is
    the token rows' static stride in kv, score, dkv and dscore; ``batch`` (SBHD) makes the
    output and grad_out rows ``batch * head_dim`` apart (sequence 0's view of them)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    W = coff * head_dim
    T, N, B1, P = (cute.sym_int32() for _ in range(4))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if direction in ("dape", "dape_wide"):
        return (_fake(cutlass.Float32, (P, ratio * W), 16),
                _fake(cutlass.Float32, (1, ratio * W), 16), stream)
    cdt = cutlass_dtype(dtype)

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
    dkv, dscore = rows(), rows()
    work = _fake(cutlass.Float32, (P, W), 16)
    return (kv, score, ape, cu, cuc, grad, dkv, dscore, work, Int32(1), Int32(1),
            Int32(1)) + ep + (stream,)


def _epilogue_args(direction, cdt, head_dim, epilogue, long: bool):
    """The epilogue's symbolic arguments (pool_epilogue's launches): flat rows of the whole
    pack (``N * batch``), their statistics, the weight, the cosine and sine rows; the
    slot-parallel forward also the rows' counts."""
    import cutlass
    import cutlass.cute as cute

    from .epilogue_rows import cos_sin_vec

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
