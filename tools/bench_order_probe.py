"""Does the order in which `bench --module` replays its graphs bias the step / GEMMs ratio?

For each of the module bench's configs, the same captured graphs timed three ways, the SM
clock (NVML) read during every replay:
  forward     every round in the bench's variant order (the GEMMs first)
  reverse     every round in the opposite order
  sequential  each graph's replays back to back (the bench before it interleaved)
  alternate   what the bench reports (the order reversed every other round)
Printed: µs a step and the median SM clock a variant and method, and step / GEMMs by method.

    python tools/bench_order_probe.py
"""

from __future__ import annotations

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)


import statistics
import sys

from csa_compressor.cli import module_bench
from csa_compressor.cli.bench import replay_us, time_graphs_interleaved

ROUNDS = 16


def timed(graphs, orders):
    times = {k: [] for k in graphs}
    clocks = {k: [] for k in graphs}
    for keys in orders:
        for k in keys:
            times[k].append(replay_us(graphs[k], clocks[k]))
    med = lambda xs: statistics.median([x for x in xs if x is not None] or [float("nan")])
    return {k: (med(times[k]), med(clocks[k])) for k in graphs}


def timer(graphs):
    keys = list(graphs)
    for k in keys:  # a few replays each, so no method runs first on a cold GPU
        for _ in range(3):
            replay_us(graphs[k])
    methods = {
        "forward": timed(graphs, [keys] * ROUNDS),
        "reverse": timed(graphs, [keys[::-1]] * ROUNDS),
        "sequential": timed(graphs, [[k] * ROUNDS for k in keys]),
    }
    alternate = time_graphs_interleaved(graphs, ROUNDS)
    for name, res in methods.items():
        print(f"  {name:10s} " + "  ".join(f"{k} {us:.0f} µs @{mhz:.0f} MHz" for k, (us, mhz) in res.items()))
        if "gemms" in res and "one_projection" in res:
            print(f"  {name:10s} step / GEMMs {res['one_projection'][0] / res['gemms'][0]:.3f}x")
    if "gemms" in alternate and "one_projection" in alternate:
        print(f"  alternate  step / GEMMs {alternate['one_projection'] / alternate['gemms']:.3f}x")
    sys.stdout.flush()
    return alternate


if __name__ == "__main__":
    for cfg in module_bench.CONFIGS:
        print(cfg[0])
        module_bench.run(configs=(cfg,), progress=lambda m: None, timer=timer)
