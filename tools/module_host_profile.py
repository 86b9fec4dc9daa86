"""Where the Compressor module's step spends host time outside CUDA graphs: the step's
wall time (back-to-back steps, synchronised at the end) against its GPU time, then
cProfile of the same steps (the package's functions and the torch calls they make).

    python tools/module_host_profile.py [d128r4rot | d512r4 | d512r128] [steps]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import _tool  # noqa: E402
from _tool import start  # noqa: E402

start(__doc__, gpu=True)
import sys
import time

import torch

from module_profile import inputs, module_step


def main(name="d128r4rot", steps=20):
    x, cu = inputs(torch.device("cuda"))
    step = module_step(name, x, cu)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e6
    print(f"{name}: host {host:.0f} µs a step (launch side), wall {wall:.0f} µs a step")
    _tool.print_cprofile(step, steps, torch.cuda.synchronize, (35, 45))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "d128r4rot", int(sys.argv[2]) if len(sys.argv) > 2 else 20)
