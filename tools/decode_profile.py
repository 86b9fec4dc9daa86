"""Developer probe: a captured decode step of bench --streaming's case (256 slots, d512,
bf16, staggered counts) kernel by kernel: torch.profiler over replays of its 20-step
graph, each kernel's launches and GPU µs a step, beside the graph's µs a step.

    python tools/decode_profile.py [ratio:coff:pooling ...]   (default 128:1:ring 4:2:ring)
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import sys
from collections import defaultdict

import torch

from csa_compressor import streaming
from csa_compressor.cli.bench import CALLS_PER_GRAPH, capture_graph, replay_us
from csa_compressor.cli.streaming_bench import DECODE_SLOTS, staggered


def main(cases):
    from torch.autograd import DeviceType
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
        steps = replays * CALLS_PER_GRAPH
        groups = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                k = e.name if len(e.name) < 90 else e.name[:87] + "..."
                groups[k][0] += 1
                groups[k][1] += e.self_device_time_total
        total = sum(v[1] for v in groups.values()) / steps
        n = sum(v[0] for v in groups.values()) / steps
        print(f"\nr{ratio} coff {coff} {pooling}: graph {us:.1f} µs a step; kernels {total:.1f} µs "
              f"a step in {n:g} launches")
        print("| kernel | launches a step | µs a step |\n|---|---|---|")
        for k, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            print(f"| `{k}` | {c / steps:g} | {t / steps:.2f} |")
        del graph


if __name__ == "__main__":
    main(sys.argv[1:] or ["128:1:ring", "4:2:ring"])
