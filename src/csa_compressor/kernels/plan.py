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

from ..checks import POOL_NUMERICS as NUMERICS
from .tuning import Tuning, current

# "decode": a streaming decode step (pool_decode), the forward's row math over slots' rings
DIRECTIONS = ("fwd", "bwd", "bwd_large", "dape", "dape_wide", "decode")


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
    # A backward that stores dscore in fp32, unrounded (kv and score of a narrower dtype):
    # for callers that reduce it themselves in another order (the transformers adapter).
    fp32_dscore: bool = False
    # False: no position bias (ape=None). The kernels read the offsets guard's flag in its
    # place (staging.WindowSlots.has_ape) and a backward writes no dape partials.
    ape: bool = True

    def __hash__(self):
        # Hashed on every launch (the compile cache's key): once, not over the tuning's fields
        # each time.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.direction, self.dtype, self.ratio, self.coff, self.head_dim, self.tuning,
                      self.row_stride, self.batch, self.numerics, self.epilogue, self.fp32_dscore, self.ape))
            object.__setattr__(self, "_hash", h)
        return h

    def __str__(self):
        rows = f", row_stride={self.row_stride}" if self.row_stride else ""
        rows += f", batch={self.batch}" if self.batch else ""
        rows += f", numerics={self.numerics!r}" if self.numerics != "fp32" else ""
        rows += f", {self.epilogue}" if self.epilogue is not None else ""
        rows += ", fp32 dscore" if self.fp32_dscore else ""
        rows += ", no ape" if not self.ape else ""
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
         numerics: str = "fp32", epilogue: EpilogueKey | None = None,
         fp32_dscore: bool = False, ape: bool = True) -> KernelSpec:
    """The spec of one specialisation under ``tuning`` (default: the current one).

    Asked on every launch, so the answer is kept: deriving the tuning's code-generating view
    cost ~15 µs of host time. The memo keys on the tuning object and keeps it alive, so its
    id cannot be reused."""
    t = tuning or current()
    key = (direction, dtype, ratio, coff, head_dim, id(t), row_stride, batch, numerics, epilogue,
           fp32_dscore, ape)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is t:
        return hit[1]
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
    if direction in ("dape", "dape_wide"):
        # the partials are fp32 whatever the inputs are, in one layout
        dtype, row_stride, batch, numerics, epilogue, ape = torch.float32, 0, 0, "fp32", None, True
    if direction == "decode":
        # the rings are packed, the epilogue runs by parts, no APE reads zeros
        row_stride, batch, epilogue, ape = 0, 0, None, True
    if direction in ("fwd", "dape", "dape_wide", "decode") or dtype == torch.float32:
        fp32_dscore = False  # no dscore, or one that is fp32 anyway
    if batch == 1:
        batch = 0  # one SBHD sequence is a one-segment pack
    if row_stride == coff * head_dim and not batch:
        row_stride = 0  # packed rows: one spec, one kernel
    if fp32_dscore and (row_stride or batch or epilogue is not None):
        raise ValueError("fp32_dscore: only for THD packs of separate kv and score tensors "
                         "without the epilogue")
    made = KernelSpec(direction, dtype, ratio, coff, head_dim, t.codegen(), row_stride, batch,
                      numerics, epilogue, fp32_dscore, ape)
    if len(_SPECS) > 4096:  # a sweep's many tunings: keep the memo small
        _SPECS.clear()
    _SPECS[key] = (t, made)
    return made


DECODE_MAX_THREADS = 1024  # a CTA's most threads: pool_decode's CTA holds a row's column chunks


def decode_designable(dtype: torch.dtype, ratio: int, coff: int, head_dim: int, tuning) -> bool:
    """Whether a decode step has its kernel (pool_decode): a register-resident window and
    a row whose column chunks (the forward's) one CTA holds."""
    if tuning.long_window(coff * ratio):
        return False
    vec = tuning.forward_vector_elems(head_dim, dtype.itemsize, coff * ratio)
    return head_dim // vec <= DECODE_MAX_THREADS


def family(s: KernelSpec) -> tuple:
    """``s`` and the specs compiled with it, ``s`` first: a backward's dape sums (both
    layouts) and a default backward's large-pack variant. kernel_for says which of them
    this specialisation has."""
    sums = tuple(replace(s, direction=d, dtype=torch.float32, row_stride=0, batch=0,
                         numerics="fp32", epilogue=None, fp32_dscore=False, ape=True)
                 for d in ("dape", "dape_wide"))
    if s.direction == "bwd":
        return (s,) + sums + (replace(s, direction="bwd_large"),)
    if s.direction == "bwd_large":
        return (s,) + sums
    return (s,)


def _fake(dtype, shape, align):
    import cutlass.cute as cute

    order = tuple(range(len(shape)))[::-1]  # row-major
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)
