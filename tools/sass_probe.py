"""Developer probe (runs on a CPU machine): compile one kernel and count its SASS
instructions, whole kernel and by opcode, optionally with kernel-shaping constants
overridden. The counts in docs/lab/tuning-*.md and docs/lab/ceilings.md come from here.

    CUTE_DSL_ARCH=sm_90a python tools/sass_probe.py fwd bfloat16 4 2 512 [K=V ...] [--dump DIR]

Needs nvdisasm on PATH (pip install nvidia-cuda-nvdisasm; it lands in
site-packages/nvidia/cu13/bin).
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=False)

import collections
import os
import re
import sys
import tempfile

args = [a for a in sys.argv[1:] if not a.startswith("--dump")]
dump = tempfile.mkdtemp()
if "--dump" in sys.argv:
    dump = sys.argv[sys.argv.index("--dump") + 1]
    args.remove(dump)
    os.makedirs(dump, exist_ok=True)  # the DSL does not create it
direction, dtype, ratio, coff, d = args[0], args[1], *map(int, args[2:5])
os.environ["CUTE_DSL_KEEP"] = "sass"
os.environ.pop("CSA_COMPRESSOR_CACHE_DIR", None)  # a cache hit would dump no SASS
os.environ["CUTE_DSL_DUMP_DIR"] = dump

import torch  # noqa: E402

from csa_compressor.kernels import compile as cc, plan  # noqa: E402
from csa_compressor.kernels import tuning  # noqa: E402

cc.build(plan.spec(direction, getattr(torch, dtype), ratio, coff, d,
                    tuning.replace(tuning.current(), **tuning.parse_overrides(",".join(args[5:])))))
sass = [f for f in os.listdir(dump) if f.endswith(".sass")]
if not sass:
    sys.exit("no .sass written: is nvdisasm on PATH?")
ops = collections.Counter()
for line in open(os.path.join(dump, sass[0])):
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if m:
        ops[m.group(1).split(".")[0]] += 1
print(f"{direction} {dtype} ratio {ratio} coff {coff} d {d} {' '.join(args[5:])}: "
      f"{sum(ops.values())} instructions")
print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))
