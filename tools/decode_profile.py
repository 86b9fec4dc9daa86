"""Developer probe: a captured decode step of bench --streaming's case (256 slots, d512,
bf16, staggered counts) kernel by kernel: torch.profiler over replays of its 20-step
graph, each kernel's launches and GPU µs a step, beside the graph's µs a step.

    python tools/decode_profile.py [ratio:coff:pooling ...]   (default 128:1:ring 4:2:ring)
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import kernel_table, start  # noqa: E402

start(__doc__, gpu=True)

import sys

import torch

from csa_compressor import streaming
from csa_compressor.cli.bench import CALLS_PER_GRAPH, capture_graph, replay_us
from csa_compressor.cli.streaming_bench import DECODE_SLOTS, staggered


def main(cases):
    from torch.profiler import ProfilerActivity, profile

    dev, d, B, replays = torch.device("cuda"), 512, DECODE_SLOTS, 3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for case in cases:
        ratio, coff, pooling = case.split(":")
        ratio, coff = int(ratio), int(coff)
        gen = torch.Generator(device=dev).manual_seed(1)
        st = streaming.StreamState(B, d, ratio=ratio, coff=coff, device=dev)
        staggered(st, gen)
        kv = torch.randn(B, 1, coff * d, device=dev, generator=gen).bfloat16()
        sc = torch.randn(B, 1, coff * d, device=dev, generator=gen).bfloat16()
        ape = torch.randn(ratio, coff * d, device=dev, generator=gen)
        slots = torch.arange(B, device=dev)
        graph = capture_graph(lambda i: streaming.decode(st, kv, sc, ape, slots, pooling=pooling), 1)
        us = sorted(replay_us(graph) for _ in range(9))[4]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        total, n, table = kernel_table(prof, replays * CALLS_PER_GRAPH, digits=2)
        print(f"\nr{ratio} coff {coff} {pooling}: graph {us:.1f} µs a step; kernels {total:.1f} µs "
              f"a step in {n:g} launches")
        print(table)
        del graph


if __name__ == "__main__":
    main(sys.argv[1:] or ["128:1:ring", "4:2:ring"])
