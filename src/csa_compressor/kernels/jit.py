"""Compiling through the DSL's TVM-FFI path, and the small kernels beside the pooling
(epilogue rows, rotary angles, offsets, column sums): each compiled once a key, or None
while a CUDA graph captures so the caller runs the torch ops it stands in for."""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import threading
import warnings
from dataclasses import dataclass

import torch

from . import disk_cache, hardware

LOCK = threading.Lock()


EIATTR_REGCOUNT = 0x2F  # an .nv.info attribute: (function symbol, registers a thread)


def cubin_registers(cubin: bytes) -> int | None:
    """Registers a thread of the cubin's kernel, as ptxas allocated them (the largest
    EIATTR_REGCOUNT of its .nv.info sections; our modules hold one kernel), or None where
    the image has none. Attributes are (format, id) bytes then a payload: none (0x01), one
    byte (0x02), two (0x03), or a 16-bit size and that many bytes (0x04)."""
    if not cubin or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return None
    try:
        return _regcount(cubin)
    except (struct.error, ValueError, IndexError):  # a truncated or foreign image
        return None


def _regcount(cubin: bytes) -> int | None:
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i):  # (name offset, offset, size) of section header i
        h = struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
        return h[0], h[4], h[5]

    names = section(shstrndx)[1]
    regs = None
    for i in range(shnum):
        name_at, off, size = section(i)
        name = cubin[names + name_at:cubin.index(b"\0", names + name_at)]
        if not name.startswith(b".nv.info"):
            continue
        p, end = off, off + size
        while p + 2 <= end:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 0x04:
                n, = struct.unpack_from("<H", cubin, p + 2)
                if attr == EIATTR_REGCOUNT and n >= 8:
                    regs = max(regs or 0, struct.unpack_from("<I", cubin, p + 8)[0])
                p += 4 + n
            elif fmt in (0x01, 0x02, 0x03):
                p += fmt + 1
            else:  # a format this reader does not know: stop rather than misread
                break
    return regs


def compile_kernel(kernel, *args):
    """cute.compile through TVM-FFI, keeping the cubin for its register count
    (WindowSlots.grid_ctas_per_sm). It is written to the DSL's dump directory where one is set
    (the probes keep the PTX there), else to a temporary one."""
    import cutlass.cute as cute

    dump = os.environ.get("CUTE_DSL_DUMP_DIR")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # The long kernels unroll their window sums on purpose (softmax_order.ordered_sum); the
        # DSL warns of that.
        warnings.filterwarnings("ignore", message="This static loop has")
        return cute.compile(kernel, *args,
                            options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump or tmp}")


def direct(fn):
    """The compiled function's ``tvm_ffi.Function`` (the TVM-FFI conversion protocol,
    ``__tvm_ffi_object__``), called without the DSL's keyword-argument wrapper, which costs
    host time on every launch (tools/perf_probe.py host). Our launches
    pass positional tensors and ints only, which is all the wrapper would forward. Falls
    back to ``fn`` where there is no such function (e.g. compiled without a GPU)."""
    conv = getattr(fn, "__tvm_ffi_object__", None)
    raw = conv() if conv is not None else None
    return raw if raw is not None else fn


@dataclass(frozen=True)
class SmallSpec:
    """What specialises one of the small kernels beside the pooling (epilogue_rows,
    rope_angles, offsets, column_sum): the fields disk_cache keys its entries on;
    small_kernel puts its whole key into ``direction``."""

    direction: str
    dtype: object = None
    ratio: int = 0
    coff: int = 0
    head_dim: int = 0
    tuning: object = None
    row_stride: int = 0
    batch: int = 0


def small_spec(key: tuple) -> SmallSpec:
    """The disk-cache identity of a small kernel's ``key`` (small_kernel): all of it."""
    return SmallSpec(" ".join(map(str, key)))


def compile_small(spec: SmallSpec, build) -> tuple:
    """``(function, owner)`` of a small kernel: loaded from the disk cache where it is on
    and holds it, else compiled from ``build()``'s ``(kernel, args)`` (and stored)."""

    def compile_unit(_):
        kernel, args = build()
        owner = compile_kernel(kernel, *args)
        return direct(owner), owner, None

    fn, owner, _ = disk_cache.fetch(spec, hardware.target_arch(), None, compile_unit)
    return fn, owner


_SMALL: dict = {}


def small_kernel(key: tuple, device: torch.device, build):
    """The launchable function of a small kernel on ``device``, compiled (or loaded) on
    first use; None where it is not compiled yet and the stream is capturing a CUDA graph:
    the caller then runs the torch ops the kernel stands in for (the same bits), where the
    pooling kernels would have to raise. ``key``: the values that specialise it, its name
    first (plain values: a call is one lookup, several a step on the host's critical
    path), which also name its disk-cache entry; ``build()``: its ``(kernel, args)``, on
    a miss only."""
    ck = (device.index, key)
    hit = _SMALL.get(ck)
    if hit is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        with LOCK:
            hit = _SMALL.get(ck)
            if hit is None:
                hit = _SMALL[ck] = compile_small(small_spec(key), build)
    return hit[0]


@contextlib.contextmanager
def stand_in_small(key: tuple, device: torch.device, fn):
    """Within the block, ``fn`` launches in place of small kernel ``key`` (small_kernel's)
    on ``device``: the seam beside compile.stand_in."""
    k = (device.index, key)
    saved = _SMALL.get(k)
    _SMALL[k] = (fn, None)
    try:
        yield
    finally:
        if saved is None:
            _SMALL.pop(k, None)
        else:
            _SMALL[k] = saved


def checked_once(table: dict, key, check) -> bool:
    """``table[key]``: whether a small kernel gives torch's bits at ``key`` (another torch
    or GPU may order or round otherwise), from ``check()`` run the first time and kept.
    ``check()`` returns None where the kernel cannot be had now: nothing is kept. While a
    CUDA graph captures, an unchecked key is False and no probe runs."""
    agrees = table.get(key)
    if agrees is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        agrees = check()
        if agrees is None:
            return False
        table[key] = agrees
    return agrees


_PLACEHOLDERS: dict = {}


def placeholder(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small kernel's argument it never touches in this specialisation (an output or
    input its flags switch off): one zero tensor a (shape, dtype, device), made once."""
    key = (shape, dtype, device)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t
