"""Where the Compressor module's training step spends its GPU time: torch.profiler's
kernels over a few steps (forward + backward, THD at static capacity, hidden 4096, bf16,
3x8192 tokens), grouped by kernel name, with each group's launches and µs a step. The
bench (`python -m csa_compressor bench --module`) times the step; this says what is in it.

    python tools/module_profile.py [d512r4 | d128r4rot | d512r128 ...]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import kernel_table, start  # noqa: E402

start(__doc__, gpu=True)
import sys

import torch

CONFIGS = {"d512r4": (512, 4, False), "d128r4rot": (128, 4, True), "d512r128": (512, 128, False)}


LENS, HIDDEN = (8192, 8192, 8192), 4096


def module_step(name, x, cu):
    """One forward + backward of the package's Compressor in config ``name`` on ``x``
    ``(sum(LENS), HIDDEN)`` bf16 (requiring grad) and offsets ``cu``."""
    from csa_compressor import Compressor

    d, ratio, rotate = CONFIGS[name]
    torch.manual_seed(0)
    m = Compressor(HIDDEN, d, ratio, rotate=rotate, dtype=torch.bfloat16, device=x.device,
                   pooling="fused")
    params = [x, *m.parameters()]
    g = torch.randn_like(m(x, cu, max_seqlen=max(LENS))[0])

    def step():
        out, _ = m(x, cu, max_seqlen=max(LENS))
        torch.autograd.grad(out, params, g)

    return step


def inputs(dev):
    """``(x, cu)``: the module's input and THD offsets over LENS."""
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    x = torch.randn(sum(LENS), HIDDEN, device=dev).bfloat16().requires_grad_(True)
    return x, cu


def main(argv):
    from torch.profiler import ProfilerActivity, profile

    steps = 5
    x, cu = inputs(torch.device("cuda"))
    for name in argv or list(CONFIGS):
        step = module_step(name, x, cu)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        total, launches, table = kernel_table(prof, steps)
        print(f"\n{name}: {total:.0f} µs a step in {launches:.0f} kernels ({torch.cuda.get_device_name()}, "
              f"torch {torch.__version__})")
        print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
