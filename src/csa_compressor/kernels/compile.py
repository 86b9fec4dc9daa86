"""Compile cache of the pooling kernels, keyed by what specialises the code.

The cache keys on (device, plan.KernelSpec): direction, dtype, ratio, coff, head_dim and
the tuning's code-generating values; token count, row count, batch size and the workspace
size stay symbolic, so packs change without recompiling.
Directions: "fwd", "bwd", "bwd_large" (the backward's variant for large packs, where it
differs: compiled with "bwd", chosen by launch.backward_kernel), and "dape" (the
backward's partial-sum reduction, fp32, one per (ratio, coff, head_dim) whatever the
dtype) with "dape_wide", its layout for few rows of many columns (compiled with "bwd"
where the columns allow it, chosen by launch.dape_sum).
Launches go through the DSL's TVM-FFI path on the caller's current torch stream.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import tempfile
import threading
import warnings
import dataclasses
from dataclasses import dataclass

import torch

from . import disk_cache, hardware, plan
from .tuning import current

_CACHE: dict = {}
_LOCK = threading.Lock()


def dsl_import_error() -> str | None:
    """None when the CuTe DSL and TVM-FFI import, else a one-line reason."""
    return _dsl_import_error()


@functools.lru_cache(maxsize=1)
def _dsl_import_error():
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"CuTe DSL unavailable ({type(exc).__name__}: {exc})"
    return None


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


def _compile(kernel, *args):
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


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: the kernel object (its design), the launchable function, ptxas'
    registers a thread, the CTAs an SM its one-wave grid is sized for (the design's,
    capped by those registers), and for a backward its dape sums (default and wide) and,
    where the specialisation has one, its large-pack variant (a Compiled itself)."""

    kernel: object
    fn: object
    registers: int | None
    ctas_per_sm: int | None
    dape: object = None
    dape_wide: object = None
    owner: object = None  # the DSL's compiled object: owns the module ``fn`` calls into
    large: object = None


def _compile_unit(unit: plan.Unit) -> tuple:
    """(function, owner, registers) of one Unit, compiled now."""
    owner = _compile(unit.kernel, *unit.args)
    regs = cubin_registers(getattr(getattr(owner, "artifacts", None), "CUBIN", None))
    return _direct(owner), owner, regs


def _records(units, device) -> dict:
    """{spec: Compiled} of the Units, each taken from the cache where it is there already
    (a dape sum two backward dtypes share), else from the disk cache or compiled; a
    backward's record carries its dape sums and its large-pack variant's record."""
    target = hardware.target_arch()
    out = {}
    for u in units:
        hit = _CACHE.get((device.type, device.index, u.spec))
        if hit is None:
            fn, owner, regs = disk_cache.fetch(u.spec, target, u, _compile_unit)
            ctas = u.kernel.grid_ctas_per_sm(regs) if hasattr(u.kernel, "grid_ctas_per_sm") else None
            hit = Compiled(u.kernel, fn, regs, ctas, owner=owner)
        out[u.spec] = hit
    by = {s.direction: c for s, c in out.items()}
    sums = {d: getattr(by.get(d), "fn", None) for d in ("dape", "dape_wide")}
    large = by.get("bwd_large")
    large = None if large is None else dataclasses.replace(large, **sums)
    for s, c in out.items():
        if s.direction == "bwd_large":
            out[s] = large
        elif s.direction == "bwd":
            out[s] = dataclasses.replace(c, **sums, large=large)
    return out


def build(spec: plan.KernelSpec, device: torch.device | None = None) -> Compiled | None:
    """The kernel of ``spec`` alone, compiled now and not kept in the in-process cache (the
    disk cache serves it where it is on), or None where the specialisation has no such
    kernel: the probes' entry point."""
    device = device or torch.device("cpu")
    units = [u for u in plan.lower(spec, hardware.target_major()) if u.spec == spec]
    return _records(units, device)[spec] if units else None


def _direct(fn):
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
        owner = _compile(kernel, *args)
        return _direct(owner), owner, None

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
        with _LOCK:
            hit = _SMALL.get(ck)
            if hit is None:
                hit = _SMALL[ck] = compile_small(small_spec(key), build)
    return hit[0]


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


def get_kernel(direction: str, device: torch.device, dtype: torch.dtype, ratio: int, coff: int,
               head_dim: int) -> Compiled:
    """The compiled kernel for this specialisation under the current tuning, compiling it
    (and its family) on first use."""
    return compiled_for(plan.spec(direction, dtype, ratio, coff, head_dim), device)


def is_compiled(spec: plan.KernelSpec, device: torch.device) -> bool:
    """Whether ``spec`` is compiled for ``device`` in this process (compiled_for would not
    compile)."""
    return (device.type, device.index, spec) in _CACHE


def compiled_for(spec: plan.KernelSpec, device: torch.device) -> Compiled:
    """The compiled kernel of ``spec`` on ``device``: the cache keys on the pair. A miss
    compiles the spec's whole family (plan.lower), so a warm-up or precompile before
    CUDA-graph capture covers every pack size and the dape sums.

    Compiling inside CUDA-graph capture would run host work that the graph cannot record
    and can invalidate the capture, so a miss during capture raises instead.
    """
    key = (device.type, device.index, spec)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"csa_compressor: the {spec} on {device} is not compiled yet and the stream is "
            "capturing a CUDA graph; run one warm-up call (or csa_compressor.precompile(...)) "
            "before capture"
        )
    err = dsl_import_error()
    if err:
        raise RuntimeError(f"csa_compressor: {err}")
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            with guard:
                built = _records(plan.lower(spec, hardware.target_major()), device)
            for s, c in built.items():
                _CACHE.setdefault((device.type, device.index, s), c)
            hit = _CACHE.get(key)
    if hit is None:
        raise ValueError(f"csa_compressor: there is no {spec} (plan.kernel_for)")
    return hit


def precompile(dtype: torch.dtype, ratio: int, coff: int, head_dim: int, device=None,
               directions=("fwd", "bwd"), packed: bool = False, sbhd_batch: int = 0,
               numerics: str = "fp32", epilogue=None, weight_dtype=None) -> None:
    """Compile ahead of time (e.g. before CUDA-graph capture); "bwd" brings its "dape" and
    its large-pack variant. ``packed``: also the kernels of the packed layout
    (compress_thd_fused_packed, the Compressor module's THD path). ``sbhd_batch``: also
    those of SBHD inputs of that many sequences (compress_sbhd_fused, and with ``packed``
    compress_sbhd_fused_packed). ``numerics``: the ops' (the "eager" kernels are others).
    ``epilogue`` (an Epilogue): also the kernels with it inside (the ops' ``epilogue=``),
    both directions asked for, for a norm weight of ``weight_dtype`` (default ``dtype``)."""
    from ..validation import (check_cuda_device, check_flag, check_int, check_pool_numerics,
                              check_specialisation)

    check_specialisation(dtype, ratio, coff, head_dim)
    check_flag("packed", packed)
    check_int("sbhd_batch", sbhd_batch, 0)
    check_pool_numerics(numerics)
    if isinstance(directions, str) or not set(directions) <= {"fwd", "bwd"} or not directions:
        raise ValueError(f"directions: expected a sequence of 'fwd' and 'bwd', got {directions!r}")
    if epilogue is not None:
        from ..epilogue import Epilogue

        if not isinstance(epilogue, Epilogue):
            raise TypeError(f"epilogue: expected a csa_compressor.Epilogue, got {type(epilogue).__name__}")
        epilogue.check(head_dim)
        if weight_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"weight_dtype: expected bf16, fp16 or fp32, got {weight_dtype}")
    device = check_cuda_device(device)
    widths = (coff * head_dim, 2 * coff * head_dim) if packed else (coff * head_dim,)
    layouts = [(w, 0) for w in widths] + [(sbhd_batch * w, sbhd_batch) for w in widths
                                          if sbhd_batch]
    keys = [None]
    if epilogue is not None:
        keys.append(plan.EpilogueKey.of(epilogue, weight_dtype or dtype))
    for row_stride, batch in layouts:
        for direction in directions:
            for key in keys:
                if key is not None and not plan.epilogue_designable(
                        dtype, ratio, coff, head_dim, hardware.target_major(),
                        current().codegen(), row_stride, batch, numerics, key):
                    continue
                compiled_for(plan.spec(direction, dtype, ratio, coff, head_dim,
                                       row_stride=row_stride, batch=batch, numerics=numerics,
                                       epilogue=key), device)
