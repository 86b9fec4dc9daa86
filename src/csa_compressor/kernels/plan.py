"""Which kernel each specialisation is built from, and the symbolic arguments it compiles
for. A specialisation is a frozen KernelSpec (direction, dtype, ratio, coff, head_dim and
the tuning's code-generating values): the compile cache's key with the device. Its kernel
object is its launch design (vectors, lanes, stages, register bound, grid target), built
from the spec and the architecture alone; compile.py compiles it and launch.py sizes each
launch from it and its registers."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .tuning import Tuning, current

DIRECTIONS = ("fwd", "bwd", "bwd_large", "dape", "dape_wide")


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32}[dtype]


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

    def companions(self) -> tuple:
        """The specs compiled and launched with this one (a backward's dape sums)."""
        return tuple(replace(self, direction=d, dtype=torch.float32)
                     for d in companions(self.direction, self.ratio, self.coff, self.head_dim,
                                         self.tuning))

    def variant(self, direction: str) -> "KernelSpec":
        return replace(self, direction=direction)

    def build(self, arch_major: int) -> tuple:
        """(kernel object, symbolic compile arguments) for ``arch_major``."""
        return (kernel_for(self.direction, self.dtype, self.ratio, self.coff, self.head_dim,
                           arch_major, self.tuning),
                compile_args(self.direction, self.dtype, self.ratio, self.coff, self.head_dim))

    def __str__(self):
        return (f"{self.direction} kernel for dtype={self.dtype}, ratio={self.ratio}, "
                f"coff={self.coff}, head_dim={self.head_dim}")


def spec(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
         tuning: Tuning | None = None) -> KernelSpec:
    """The spec of one specialisation under ``tuning`` (default: the current one)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if direction in ("dape", "dape_wide"):
        dtype = torch.float32  # the partials are fp32 whatever the inputs are
    return KernelSpec(direction, dtype, ratio, coff, head_dim, (tuning or current()).codegen())


def companions(direction: str, ratio: int, coff: int, head_dim: int, tuning) -> tuple:
    """The kernels a direction launches with, compiled with it: a backward's dape sum, and
    its wide layout where the partials have the columns for it."""
    if direction not in ("bwd", "bwd_large"):
        return ()
    return ("dape", "dape_wide") if tuning.dape_has_wide(ratio * coff * head_dim) else ("dape",)


def kernel_for(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
               arch_major: int, tuning):
    """The kernel object of one specialisation: windows of more than MAX_REG_SLOTS slots
    take the slot-parallel kernels, the rest the register-resident ones; ``bwd_large`` is
    the register-resident backward's large-pack variant; ``dape`` / ``dape_wide`` the two
    layouts of the backward's partial sum."""
    from .dape_reduce import DapeReduce
    from .pool_bwd import PoolBackward
    from .pool_fwd import PoolForward
    from .pool_long import LongPoolBackward, LongPoolForward

    cdt = cutlass_dtype(dtype)
    if direction in ("dape", "dape_wide"):
        return DapeReduce(ratio * coff * head_dim, wide=direction == "dape_wide", tuning=tuning)
    if tuning.long_window(coff * ratio):
        if direction == "fwd":
            return LongPoolForward(cdt, ratio, coff, head_dim, tuning=tuning)
        return LongPoolBackward(cdt, ratio, coff, head_dim, tuning=tuning)
    if direction == "fwd":
        return PoolForward(cdt, ratio, coff, head_dim, arch_major, tuning=tuning)
    return PoolBackward(cdt, ratio, coff, head_dim, arch_major, large=direction == "bwd_large",
                        tuning=tuning)


def _fake(dtype, shape, align):
    import cutlass.cute as cute

    order = tuple(range(len(shape)))[::-1]  # row-major
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def compile_args(direction: str, dtype: torch.dtype, ratio: int, coff: int, head_dim: int) -> tuple:
    """Symbolic arguments of a direction's launch: token, row, batch and partial-row counts
    stay symbolic, so packs change without recompiling."""
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
    kv, score = _fake(cdt, (T, W), 16), _fake(cdt, (T, W), 16)
    ape = _fake(cutlass.Float32, (ratio, W), 16)
    cu, cuc = _fake(cutlass.Int32, (B1,), 4), _fake(cutlass.Int32, (B1,), 4)
    if direction == "fwd":
        return kv, score, ape, cu, cuc, _fake(cdt, (N, head_dim), 16), Int32(1), stream
    grad = _fake(cdt, (N, head_dim), 16)
    dkv, dscore = _fake(cdt, (T, W), 16), _fake(cdt, (T, W), 16)
    work = _fake(cutlass.Float32, (P, W), 16)
    return (kv, score, ape, cu, cuc, grad, dkv, dscore, work, Int32(1), Int32(1), Int32(1),
            stream)
