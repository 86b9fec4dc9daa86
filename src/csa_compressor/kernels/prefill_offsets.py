"""A prefill into empty slots writes its pack's offsets and the tail kernel's ints on the
device from its launch parameters: the token offsets, the row offsets and, a call slot,
prefill_tail's (slot, first chunk row, new tokens, 0 tokens before, first output row).
The values come as one tuple of ints in the launch itself, so the host copies nothing:
a copy from pinned memory and its event bookkeeping were the largest piece of such a
call's host time before its pooling launched (docs/lab/streaming.md).

One thread writes them in order (at most a few hundred stores); the host has checked
them (offsets from 0, non-decreasing, within int32; slots in range)."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .jit import small_kernel
from .prefill_tail import META

# call slots a compiled kernel takes (its parameters padded to the next); beyond the
# last, the caller uploads the values
CAPACITIES = (8, 16, 32, 64)


def values_type(cap: int):
    """The launch's values: the token offsets padded to ``cap + 1``, then the slots padded
    to ``cap`` (a NamedTuple of Int32, which TVM-FFI takes as one tuple argument)."""
    return NamedTuple(f"PrefillValues{cap}", [(f"v{i}", Int32) for i in range(2 * cap + 1)])


def _kernel_class(cap: int, ratio: int):
    Values = values_type(cap)

    class PrefillOffsets:
        @cute.jit
        def __call__(self, mOut: cute.Tensor, vals: Values, n: Int32, stream):
            self.kernel(mOut, vals, n).launch(grid=[1, 1, 1], block=[32, 1, 1],
                                              stream=stream)

        @cute.kernel
        def kernel(self, mOut: cute.Tensor, vals: Values, n: Int32):
            tid, _, _ = cute.arch.thread_idx()
            if tid == 0:
                k = n + 1  # offsets a list
                row = Int32(0)
                mOut[0] = Int32(0)
                mOut[k] = Int32(0)
                for i in cutlass.range_constexpr(cap):
                    if i < n:
                        start, end = vals[i], vals[i + 1]
                        new = end - start
                        at = 2 * k + META * i
                        mOut[at] = vals[cap + 1 + i]
                        mOut[at + 1] = start
                        mOut[at + 2] = new
                        mOut[at + 3] = Int32(0)
                        mOut[at + 4] = row
                        row = row + new // ratio
                        mOut[i + 1] = end
                        mOut[k + i + 1] = row

    return PrefillOffsets(), Values


def compile_args(Values, cap: int) -> tuple:
    """Symbolic output length (one compile a capacity and ratio)."""
    from .plan import _fake

    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (_fake(Int32, (cute.sym_int32(),), 4), Values(*[Int32(0)] * (2 * cap + 1)),
            Int32(1), stream)


def _build(cap: int, ratio: int):
    kernel, Values = _kernel_class(cap, ratio)
    return kernel, compile_args(Values, cap)


def prefill_offsets(cap: int, ratio: int, device):
    """The launchable kernel for ``cap`` call slots (one of CAPACITIES) at ``ratio``, or
    None where it cannot be had now (jit.small_kernel). Its launch: ``fn(out, values,
    slots)`` with ``out`` int32 ``(2 * (slots + 1) + META * slots,)`` and ``values``
    values_type(cap)'s ints as a tuple."""
    return small_kernel(("prefill_offsets", cap, ratio), device, lambda: _build(cap, ratio))
