"""Compile one kernel for CUTE_DSL_ARCH on this (CPU) machine and print what ptxas and the PTX
say about it as JSON. Run in a subprocess: the DSL reads its environment at import."""

import contextlib
import io
import json
import os
import re
import sys
import tempfile

import torch

direction, dtype, ratio, coff, d = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
row_stride = int(sys.argv[6]) if len(sys.argv) > 6 else 0  # 0: packed rows
batch = int(sys.argv[7]) if len(sys.argv) > 7 else 0  # SBHD sequences (0: THD)
numerics = sys.argv[8] if len(sys.argv) > 8 else "fp32"
# the epilogue inside the kernels, "rope_dim:interleaved:rotate:weight dtype" ("" none)
epilogue = sys.argv[9] if len(sys.argv) > 9 else ""
fp32_dscore = len(sys.argv) > 10 and sys.argv[10] == "1"  # a backward's dscore stored in fp32
ape = not (len(sys.argv) > 11 and sys.argv[11] == "noape")  # no position bias
dump = os.environ.get("PROBE_DUMP") or tempfile.mkdtemp()
os.environ["CUTE_DSL_KEEP"] = "ptx"
os.environ["CUTE_DSL_DUMP_DIR"] = dump
os.environ["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"

import cutlass.cute as cute  # noqa: E402

from csa_compressor.kernels import compile as cc, plan  # noqa: E402
# CSA_CONFIG="K=V,K=V" (a sweep variant) is read by kernels/tuning.py at import.

_orig = cute.compile


def _verbose(*a, options="", **k):
    return _orig(*a, options=options + " --ptxas-options=-v", **k)


cute.compile = _verbose

# The shared memory the kernel's allocators hand out, modelled as they allocate: one running
# end over every SmemAllocator of the kernel (the DSL sums them: a second allocator's
# buffers follow the first's), each allocation aligned up to its alignment. A launch that
# asks for less than that end overruns (compute-sanitizer caught one; the DSL itself
# reports "may exceed available memory set in kernel launch").
from cutlass.memory import SmemAllocator  # noqa: E402

_allocate = SmemAllocator.allocate
smem_ends = {}


def _modelled(self, size, byte_alignment=1, *a, **k):
    if isinstance(size, int):
        at = -(-smem_ends.get("end", 0) // byte_alignment) * byte_alignment
        smem_ends["end"] = at + size
    return _allocate(self, size, byte_alignment, *a, **k)


SmemAllocator.allocate = _modelled
buf = io.StringIO()
with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
    ep = None
    if epilogue:
        rope, inter, rot, wdt = epilogue.split(":")
        ep = plan.EpilogueKey(int(rope), inter == "1", rot == "1", 1e-6, getattr(torch, wdt))
    built = cc.build(plan.spec(direction, getattr(torch, dtype), ratio, coff, d,
                               row_stride=row_stride, batch=batch, numerics=numerics,
                               epilogue=ep, fp32_dscore=fp32_dscore, ape=ape))
if built is None:  # the specialisation has no such kernel (catalog.kernel_for)
    print(json.dumps({"absent": True}))
    sys.exit(0)
kernel = built.kernel
log = buf.getvalue()
ptx = "".join(open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx"))
regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
loads = {}
for m in re.findall(r"ld\.global(?:\.nc)?((?:\.v\d)?)\.(?:b|u|f|s)(\d+)", ptx):
    width = (int(m[0][2:]) if m[0] else 1) * int(m[1]) // 8
    loads[width] = loads.get(width, 0) + 1
stores = {}
for m in re.findall(r"st\.global((?:\.v\d)?)\.(?:b|u|f|s)(\d+)", ptx):
    width = (int(m[0][2:]) if m[0] else 1) * int(m[1]) // 8
    stores[width] = stores.get(width, 0) + 1
copies = {}
for m in re.findall(r"cp\.async\.c[ag]\.shared(?:::cta)?\.global[^,]*,[^,]*,\s*(\d+)", ptx):
    copies[int(m)] = copies.get(int(m), 0) + 1
# Where the programmatic-dependent wait sits against the first global memory access: a
# kernel launched with use_pdl may start while its predecessor still runs, so nothing may
# touch global memory before griddepcontrol.wait (-1: no wait in the kernel).
wait_at = ptx.find("griddepcontrol.wait")
first_mem = re.search(r"\b(?:ld|st|cp\.async|atom|red)\.[a-z0-9.:]*global", ptx)
wait_first = wait_at >= 0 and (first_mem is None or wait_at < first_mem.start())
min_ctas = [int(x) for x in re.findall(r"\.minnctapersm\s+(\d+)", ptx)]
print(json.dumps({"pdl_wait": wait_at >= 0, "pdl_wait_first": wait_first, "min_ctas": min_ctas,
                  "async_copies_by_bytes": copies, "rcp_rn": ptx.count("rcp.rn.f32"),
                  "ballots": ptx.count("vote.sync.ballot"), "arch": os.environ.get("CUTE_DSL_ARCH"), "regs": regs, "spills": spills, "stack": stack,
                  "local": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
                  "mul_rn": ptx.count("mul.rn.f32"), "loads_by_bytes": loads,
                  "nc_loads": ptx.count("ld.global.nc"),
                  "stores_by_bytes": stores,
                  "shfl_bfly": ptx.count("shfl.sync.bfly"), "bar_sync": len(re.findall(r"\bbar(?:rier)?\.sync", ptx)),
                  "cvt_rn": len(re.findall(r"cvt\.rn\.(?:bf16|f16)\.f32", ptx)),
                  "cvt_rn_x2": len(re.findall(r"cvt\.rn\.(?:bf16|f16)x2\.f32", ptx)),
                  "vec": kernel.vec, "elem_bytes": torch.tensor([], dtype=getattr(torch, dtype)).element_size(),
                  "slots": getattr(kernel, "slots", 0), "ptx_bytes": len(ptx),
                  "chunk_slots": getattr(kernel, "chunk_slots", 0),  # slots a thread reads
                  "coop": bool(getattr(kernel, "coop", False)),
                  # The grid's CTAs an SM as designed (shared memory, tuning), and as
                  # launched: capped by what the cubin's registers leave resident.
                  "target_ctas": getattr(kernel, "target_ctas_per_sm", None) or 0,
                  "grid_ctas": built.ctas_per_sm or 0,
                  "cubin_regs": built.registers,
                  "threads": getattr(kernel, "threads", 0),
                  "smem_asked": getattr(kernel, "smem_bytes", 0),
                  "smem_used": max(smem_ends.values(), default=0)}))
