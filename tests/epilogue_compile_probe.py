"""Compile kernels.epilogue_rows for CUTE_DSL_ARCH on this (CPU) machine and print what ptxas
says of each geometry as JSON lines. Run in a subprocess: the DSL reads its environment at
import."""

import contextlib
import io
import json
import os
import re
import sys
import tempfile

import torch

os.environ["CUTE_DSL_KEEP"] = "ptx"  # as tests/compile_probe.py: ptxas' report comes with it
os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp()
os.environ["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from csa_compressor.kernels import column_sum as cs  # noqa: E402
from csa_compressor.kernels import decode_entries as de  # noqa: E402
from csa_compressor.kernels import epilogue_rows as er  # noqa: E402
from csa_compressor.kernels import offsets as off  # noqa: E402
from csa_compressor.kernels import prefill_offsets as po  # noqa: E402
from csa_compressor.kernels import grouped_offsets as go  # noqa: E402
from csa_compressor.kernels import prefill_tail as pt  # noqa: E402
from csa_compressor.kernels import rope_angles as ra  # noqa: E402
from csa_compressor.kernels.jit import compile_kernel as _compile  # noqa: E402
from csa_compressor.kernels.plan import cutlass_dtype  # noqa: E402

_orig = cute.compile
cute.compile = lambda *a, options="", **k: _orig(*a, options=options + " --ptxas-options=-v", **k)


def build(spec):
    """The kernel and its arguments:
    ``dtype:head_dim:rope_dim:interleaved:rotate:backward[:norm[:weight_dtype]]`` (epilogue_rows), ``positions``, ``angles:pairs`` or ``trig:pairs`` (rope_angles), ``offsets:ratio``, ``guard:ratio`` (the offsets' guard),
    ``colsum:head_dim:lanes:finish`` (column_sum), ``tail:dtype:width:ratio`` (prefill_tail),
    ``entries:dtype:width:ratio`` (decode_entries), ``poffsets:capacity:ratio``
    (prefill_offsets), ``goffsets:ratio:ids dtype`` (grouped_offsets)."""
    if spec.startswith("goffsets:"):
        _, ratio, ids = spec.split(":")
        return go.GroupedOffsets(int(ratio)), go.compile_args(getattr(cutlass, ids.capitalize()))
    if spec.startswith("poffsets:"):
        _, cap, ratio = spec.split(":")
        return po._build(int(cap), int(ratio))
    if spec.startswith("colsum:"):
        _, d, lanes, finish = spec.split(":")
        return cs.ColumnSum(int(d), int(lanes), finish == "1"), cs.compile_args(int(d))
    if spec.startswith("offsets:"):
        return off.CompressedOffsets(int(spec.split(":")[1])), off.compile_args()
    if spec.startswith("tail:"):
        _, dt, width, ratio = spec.split(":")
        cdt, w = cutlass_dtype(getattr(torch, dt)), int(width)
        vec = pt.tail_vector(w, getattr(torch, dt).itemsize)
        return pt.PrefillTail(cdt, w, vec, int(ratio)), pt.compile_args(cdt, w)
    if spec.startswith("entries:"):
        _, dt, width, ratio = spec.split(":")
        cdt, w = cutlass_dtype(getattr(torch, dt)), int(width)
        vec = pt.tail_vector(w, getattr(torch, dt).itemsize)
        return de.DecodeEntries(cdt, w, vec, int(ratio)), de.compile_args(cdt, w)
    if spec.startswith("guard:"):
        return off.OffsetsGuard(int(spec.split(":")[1])), off.guard_compile_args()
    if spec == "positions":
        return ra.RopePositions(), ra.compile_args("positions")
    if spec.startswith(("angles:", "trig:")):
        kind, pairs = spec.split(":")
        return ra.RopeAngles(int(pairs), kind == "trig"), ra.compile_args(kind, int(pairs))
    dt, d, R, inter, rot, bwd, *rest = spec.split(":")
    dtype, d, R = getattr(torch, dt), int(d), int(R)
    inter, rot, bwd = (v == "1" for v in (inter, rot, bwd))
    norm = bool(rest) and rest[0] == "1"
    wdtype = getattr(torch, rest[1]) if len(rest) > 1 else None
    return (er.EpilogueRows(cutlass_dtype(dtype), d, R, inter, rot, bwd, norm),
            er.compile_args(dtype, d, R, inter, bwd, norm, wdtype))


DUMP = os.environ["CUTE_DSL_DUMP_DIR"]

for spec in sys.argv[1:]:
    kernel, args = build(spec)
    # a file name comes from the argument types, so another specialisation may rewrite one
    before = {f: os.stat(os.path.join(DUMP, f)).st_mtime_ns for f in os.listdir(DUMP)}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        _compile(kernel, *args)
    log = buf.getvalue()
    ptx = "".join(open(os.path.join(DUMP, f)).read() for f in os.listdir(DUMP)
                  if f.endswith(".ptx")
                  and before.get(f) != os.stat(os.path.join(DUMP, f)).st_mtime_ns)
    # as tests/compile_probe.py: a programmatic dependent touches no global memory before
    # griddepcontrol.wait (-1: no wait)
    wait_at = ptx.find("griddepcontrol.wait")
    first_mem = re.search(r"\b(?:ld|st|cp\.async|atom|red)\.[a-z0-9.:]*global", ptx)
    print(json.dumps({"spec": spec, "ptx": bool(ptx), "pdl_wait": wait_at >= 0,
                      "pdl_wait_first": wait_at >= 0 and (first_mem is None
                                                          or wait_at < first_mem.start()),
                      "regs": [int(x) for x in re.findall(r"Used (\d+) registers", log)],
                      "spills": [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)],
                      "stack": [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]}))
