"""Whether torch's CUDA reduce adds a contiguous fp32 ``(N, d)`` tensor's columns
(``x.sum(0)``: the norm weight's gradient in the epilogue's backward) in the order
softmax_order.torch_colsum_order models for this GPU, bit for bit, over a grid of shapes:
run it on a new torch or GPU before trusting kernels.column_sum there (the package also
checks each geometry once at run time).

    python tools/torch_colsum_order_probe.py [N,...] [d,...]
"""
import sys

import torch

from csa_compressor.softmax_order import colsum_in_order, torch_colsum_order


def main(argv):
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
