"""Developer probe (H200): run the fused forward and backward on one shape a few times, for
``ncu`` to profile. Not part of the package.

    ncu --clock-control none -k regex:kernel --launch-skip 4 --launch-count 3 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python tools/profile_probe.py 3x8192:512:4:2

PROBE_CONFIG="K=V,..." profiles a sweep variant (kernels/tuning.py constants overridden).
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import os
import sys

import torch

os.environ.setdefault("CSA_CONFIG", os.environ.get("PROBE_CONFIG", ""))  # read at import

from csa_compressor import compress_thd_fused, testing  # noqa: E402

shape = testing.parse_shape(sys.argv[1] if len(sys.argv) > 1 else "3x8192:512:4:2")
kv, score, ape, cu, cuc, N, g = testing.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
for _ in range(4):
    out = compress_thd_fused(*leaves, cu, cuc, N, ratio=shape.ratio, coff=shape.coff)
    out.backward(g)
torch.cuda.synchronize()
