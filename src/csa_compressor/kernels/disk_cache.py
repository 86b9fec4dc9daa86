"""Compiled kernels kept on disk across processes, opt-in: ``CSA_COMPRESSOR_CACHE_DIR``.

A compiled specialisation is exported through the DSL's ahead-of-time path (its TVM-FFI
function to an object file, linked into a shared library with the host C compiler, ``CC``
or ``cc``) beside a small JSON record (ptxas' registers a thread). A later process loads
the library instead of tracing and compiling. The entry's name hashes everything the code
depends on: the DSL and TVM-FFI versions, the package's kernel sources, the target
architecture and the spec (direction, dtype, ratio, coff, head_dim, the tuning's
code-generating values, the row stride). Entries are written to a temporary name and renamed into place,
the record last, so processes sharing the directory only ever see complete entries. Any
failure to store or load is logged once and the kernel compiles as without the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile

ENV = "CSA_COMPRESSOR_CACHE_DIR"
_log = logging.getLogger("csa_compressor.cache")
_warned = set()


def directory() -> str | None:
    """The cache directory, or None where the cache is off (the default)."""
    return os.environ.get(ENV) or None


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """The package sources the generated code depends on: every kernel module and the
    summation orders they follow."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py"))
    paths.append(os.path.join(os.path.dirname(here), "softmax_order.py"))
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _versions() -> str:
    import cutlass
    import tvm_ffi

    return (f"cutlass-dsl={getattr(cutlass, '__version__', 'unknown')};"
            f"tvm-ffi={getattr(tvm_ffi, '__version__', 'unknown')}")


def entry_name(spec, arch: str) -> str:
    key = repr((_versions(), _sources_digest(), arch, spec.direction, str(spec.dtype), spec.ratio,
                spec.coff, spec.head_dim, spec.tuning, spec.row_stride, spec.batch,
                getattr(spec, "numerics", "fp32"), getattr(spec, "epilogue", None),
                getattr(spec, "fp32_dscore", False), getattr(spec, "ape", True)))
    return hashlib.sha256(key.encode()).hexdigest()[:40]


def symbol(name: str) -> str:
    """The exported function's name in entry ``name``'s library. Unique per entry: the DSL
    loads libraries into the process' global symbol scope, where the first library's
    function would answer every later lookup of a shared name."""
    return "csa_" + name


def _warn(what: str, exc: Exception):
    if what not in _warned:
        _warned.add(what)
        _log.warning("csa_compressor: the compile cache in %s could not %s (%s: %s); compiling "
                     "instead", directory(), what, type(exc).__name__, exc)


def load(spec, arch: str):
    """``(function, module, registers)`` of a stored entry, or None."""
    d = directory()
    if d is None:
        return None
    name = entry_name(spec, arch)
    base = os.path.join(d, name)
    if not os.path.exists(base + ".json"):
        return None
    try:
        with open(base + ".json") as f:
            record = json.load(f)
        import cutlass.runtime

        module = cutlass.runtime.load_module(base + ".so", enable_tvm_ffi=True)
        return getattr(module, symbol(name)), module, record["registers"]
    except Exception as exc:  # a damaged or foreign entry: compile as without the cache
        _warn("load an entry", exc)
        return None


def store(spec, arch: str, fn, registers) -> None:
    """Export the compiled ``fn`` of ``spec`` into the cache (a no-op where it is off)."""
    d = directory()
    if d is None:
        return
    name = entry_name(spec, arch)
    base = os.path.join(d, name)
    tmp = None
    try:
        os.makedirs(d, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=d, prefix=".tmp-")
        obj, lib, rec = (os.path.join(tmp, n) for n in ("k.o", "k.so", "k.json"))
        fn.export_to_c(obj, function_name=symbol(name))
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-o", lib, obj], check=True,
                       capture_output=True, timeout=120)
        with open(rec, "w") as f:
            json.dump({"registers": registers, "spec": str(spec), "arch": arch}, f)
        os.replace(lib, base + ".so")
        os.replace(rec, base + ".json")  # last: a record means its library is complete
    except Exception as exc:
        _warn("store an entry", exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def fetch(spec, arch: str, unit, compile_unit):
    """``(function, owner, registers)`` of ``unit``: loaded from the cache where it holds
    the entry, else ``compile_unit(unit)`` and stored (both only where the cache is on)."""
    stored = load(spec, arch)
    if stored is not None:
        return stored
    fn, owner, regs = compile_unit(unit)
    store(spec, arch, owner, regs)
    return fn, owner, regs
