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
import dataclasses
from dataclasses import dataclass

import torch

from ..runtime import dsl_import_error
from . import disk_cache, hardware, plan
from . import jit
from .jit import LOCK, cubin_registers, direct
from .tuning import current

_CACHE: dict = {}


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
    owner = jit.compile_kernel(unit.kernel, *unit.args)
    regs = cubin_registers(getattr(getattr(owner, "artifacts", None), "CUBIN", None))
    return direct(owner), owner, regs


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
    return _wired(out)


def _wired(out: dict) -> dict:
    """A family's records with a backward's dape sums and large-pack variant attached."""
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


@contextlib.contextmanager
def stand_in(spec: plan.KernelSpec, device: torch.device, fn, arch_major: int = 9):
    """Within the block, ``fn`` launches in place of ``spec``'s compiled family (its dape
    sums and large-pack variant included) on ``device``, any device: the seam through which
    the CPU tests and tools/host_python_probe.py drive the launch layer without compiling.
    The kernels' designs, which size each launch, stay the real ones for ``arch_major``."""
    from . import catalog  # the kernel classes need the DSL (not a GPU)

    recs = _wired({u.spec: Compiled(u.kernel, fn, None, None)
                   for u in catalog.lower(spec, arch_major)})
    keys = [(device.type, device.index, s) for s in recs]
    saved = {k: _CACHE[k] for k in keys if k in _CACHE}
    _CACHE.update(zip(keys, recs.values()))
    try:
        yield
    finally:
        for k in keys:
            _CACHE.pop(k, None)
        _CACHE.update(saved)


def build(spec: plan.KernelSpec, device: torch.device | None = None) -> Compiled | None:
    """The kernel of ``spec`` alone, compiled now and not kept in the in-process cache (the
    disk cache serves it where it is on), or None where the specialisation has no such
    kernel: the probes' entry point."""
    device = device or torch.device("cpu")
    units = [u for u in _lower(spec) if u.spec == spec]
    return _records(units, device)[spec] if units else None


def get_kernel(direction: str, device: torch.device, dtype: torch.dtype, ratio: int, coff: int,
               head_dim: int, tuning=None) -> Compiled:
    """The compiled kernel for this specialisation under ``tuning`` (default: the
    process's), compiling it (and its family) on first use."""
    return compiled_for(plan.spec(direction, dtype, ratio, coff, head_dim, tuning), device)


def is_compiled(spec: plan.KernelSpec, device: torch.device) -> bool:
    """Whether ``spec`` is compiled for ``device`` in this process (compiled_for would not
    compile)."""
    return (device.type, device.index, spec) in _CACHE


def compiled_for(spec: plan.KernelSpec, device: torch.device) -> Compiled:
    """The compiled kernel of ``spec`` on ``device``: the cache keys on the pair. A miss
    compiles the spec's whole family (catalog.lower), so a warm-up or precompile before
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
    with LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            with guard:
                built = _records(_lower(spec), device)
            for s, c in built.items():
                _CACHE.setdefault((device.type, device.index, s), c)
            hit = _CACHE.get(key)
    if hit is None:
        raise ValueError(f"csa_compressor: there is no {spec} (catalog.kernel_for)")
    return hit


def precompile(dtype: torch.dtype, ratio: int, coff: int, head_dim: int, device: torch.device,
               directions: tuple, layouts: tuple, numerics: str, epilogue=None,
               tuning=None, ape: bool = True) -> None:
    """Compile ``directions`` for each ``(row_stride, batch)`` of ``layouts``, and with an
    ``epilogue`` (a plan.EpilogueKey) the kernels with it inside where the design takes it.
    The arguments are checked by the caller (kernel_api.precompile)."""
    for row_stride, batch in layouts:
        for direction in directions:
            for key in (None, epilogue) if epilogue is not None else (None,):
                if key is not None and not epilogue_designable(
                        dtype, ratio, coff, head_dim, hardware.target_major(),
                        (tuning or current()).codegen(), row_stride, batch, numerics, key):
                    continue
                compiled_for(plan.spec(direction, dtype, ratio, coff, head_dim, tuning,
                                       row_stride=row_stride, batch=batch, numerics=numerics,
                                       epilogue=key, ape=ape), device)


def _lower(spec: plan.KernelSpec) -> tuple:
    from . import catalog  # the kernel classes need the DSL: imported at the first compile

    return catalog.lower(spec, hardware.target_major())


def epilogue_designable(*args) -> bool:
    """catalog.epilogue_designable: whether the pooling kernels take the epilogue inside."""
    from . import catalog

    return catalog.epilogue_designable(*args)
