"""Whether torch's CUDA reduce adds a contiguous fp32 ``(N, d)`` tensor's columns
(``x.sum(0)``: the norm weight's gradient in the epilogue's backward) in the order
softmax_order.torch_colsum_order models for this GPU, bit for bit, over a grid of shapes:
run it on a new torch or GPU before trusting kernels.column_sum there (the package also
checks each geometry once at run time).

    python tools/torch_colsum_order_probe.py [N,...] [d,...]
    python tools/torch_colsum_order_probe.py time

``time``: µs a call of the column sum at the module's three geometries, as the bench
times (graphs of 20 calls over rotating inputs), each after the full-size write that
precedes it in the epilogue's backward: kernels.column_sum against torch's ``sum(0)``,
less that write alone.
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)
import sys

import torch

from csa_compressor.softmax_order import colsum_in_order, torch_colsum_order


def time_it():
    from csa_compressor.cli.bench import capture_graph, time_graphs_interleaved
    from csa_compressor.kernels import column_sum
    from csa_compressor.kernels.hardware import sm_count, threads_per_sm

    dev = torch.device("cuda")
    sets = 6
    for N, d in ((6144, 128), (6144, 512), (192, 512)):
        lanes, ctas = torch_colsum_order(N, d, sm_count(dev.index), threads_per_sm(dev.index))
        src = [torch.randn(N, d, device=dev) for _ in range(sets)]
        dst = [torch.empty_like(t) for t in src]

        def write(i):  # what the epilogue's backward kernel does before the sum: write the products
            torch.mul(src[i], 1.5, out=dst[i])

        def ours(i):
            write(i)
            column_sum.column_sum(dst[i], lanes, ctas)

        def theirs(i):
            write(i)
            dst[i].sum(0)

        ours(0)  # compile outside the capture
        graphs = {k: capture_graph(f, sets) for k, f in
                  (("write", write), ("ours", ours), ("torch", theirs))}
        us = time_graphs_interleaved(graphs, 21)
        print(f"N={N} d={d} lanes={lanes} ctas={ctas}: column_sum {us['ours'] - us['write']:.2f} µs, "
              f"torch sum(0) {us['torch'] - us['write']:.2f} µs (the write alone {us['write']:.2f})",
              flush=True)
    return 0


def main(argv):
    if argv[:1] == ["time"]:
        return time_it()
    Ns = ([int(v) for v in argv[0].split(",")] if argv
          else [16, 63, 64, 100, 192, 257, 1000, 1024, 6144, 6150, 24576])
    ds = [int(v) for v in argv[1].split(",")] if len(argv) > 1 else [64, 96, 128, 512]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, tps = props.multi_processor_count, props.max_threads_per_multi_processor
    g = torch.Generator(dev).manual_seed(0)
    print(f"torch {torch.__version__}, {props.name}: {sms} SMs, {tps} threads an SM")
    misses = 0
    for d in ds:
        for N in Ns:
            x = torch.randn(N, d, device=dev, generator=g) * torch.rand(N, 1, device=dev, generator=g) * 10
            lanes, ctas = torch_colsum_order(N, d, sms, tps)
            same = torch.equal(colsum_in_order(x, lanes, ctas), x.sum(0))
            misses += not same
            print(f"N={N} d={d} lanes={lanes} ctas={ctas}: {'torch' if same else 'DIFFERS'}", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
