"""Time one specialisation's build in a fresh process (import, then kernels.compile._build):
the first-call compile cost a training process pays.

    CUTE_DSL_ARCH=sm_90a python tools/compile_time_probe.py fwd 4 2 512
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=False)
import sys, time
t0 = time.perf_counter()
import torch
from csa_compressor.kernels import compile as cc, plan
t1 = time.perf_counter()
cc.build(plan.spec(sys.argv[1], torch.bfloat16, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
t2 = time.perf_counter()
print(f"import {t1-t0:.2f}s build {t2-t1:.2f}s")
