"""Where the Compressor module's step spends host time outside CUDA graphs: the step's
wall time (back-to-back steps, synchronised at the end) against its GPU time, then
cProfile of the same steps (the package's functions and the torch calls they make).

    python tools/module_host_profile.py [d128r4rot | d512r4 | d512r128] [steps]
"""
import cProfile
import pstats
import sys
import time

import torch

CONFIGS = {"d512r4": (512, 4, False), "d128r4rot": (128, 4, True), "d512r128": (512, 128, False)}


def main(name="d128r4rot", steps=20):
    from csa_compressor import Compressor

    d, ratio, rotate = CONFIGS[name]
    dev = torch.device("cuda")
    lens, hidden = (8192, 8192, 8192), 4096
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    x = torch.randn(sum(lens), hidden, device=dev).bfloat16().requires_grad_(True)
    torch.manual_seed(0)
    m = Compressor(hidden, d, ratio, rotate=rotate, dtype=torch.bfloat16, device=dev, pooling="fused")
    params = [x, *m.parameters()]
    g = torch.randn_like(m(x, cu, max_seqlen=max(lens))[0])

    def step():
        out, _ = m(x, cu, max_seqlen=max(lens))
        torch.autograd.grad(out, params, g)

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
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "d128r4rot", int(sys.argv[2]) if len(sys.argv) > 2 else 20)
