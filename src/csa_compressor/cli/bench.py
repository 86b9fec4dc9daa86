"""`python -m csa_compressor bench`: eager vs torch.compile vs fused, side by side.

Method: 20 calls captured in one CUDA graph, the graph replayed, time per call = replay
time / 20, median over replays (one graph launch costs ~10 µs on the H200 host, so a graph
of one call would time the launch). The 20 calls rotate over enough copies of the inputs
that their total exceeds twice the L2, so no call reads another call's data out of L2;
``same_inputs`` (the command's ``--same-inputs``) gives all 20 the same ones instead, so
packs that fit the L2 (50 MB on the H200) are read from it after the first call.
Forward is timed with inputs that require grad (the training setting: each
implementation saves what its backward needs). The floor is the bytes that must move
(forward: read kv and score, write out; backward: read kv, score and grad_out, write dkv
and dscore) over the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys

import torch

from .. import reference
from ..shapes import COMPILE_DEFAULT, Shape
from ..testing import make_inputs

CALLS_PER_GRAPH = 20


def floor_bytes(shape: Shape, N: int, elem: int):
    T, W = sum(shape.lens), shape.coff * shape.d
    fwd = 2 * T * W * elem + N * shape.d * elem
    bwd = 2 * T * W * elem + N * shape.d * elem + 2 * T * W * elem
    return fwd, fwd + bwd


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), outside graphs."""
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del x, y
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2]


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_graph(step, n_sets: int, replays: int = 15) -> float:
    """µs per call: CALLS_PER_GRAPH calls in one graph, rotating over n_sets inputs."""
    graph = capture_graph(step, n_sets)
    us = time_graphs_interleaved({"step": graph}, replays)["step"]
    del graph
    return us


def capture_graph(step, n_sets: int):
    """A CUDA graph of CALLS_PER_GRAPH calls of ``step`` rotating over n_sets inputs (each
    input set run once beforehand, on a side stream), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_sets):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            step(i % n_sets)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graphs_interleaved(graphs: dict, rounds: int = 16) -> dict:
    """µs per call of each captured graph, the graphs replayed in turn every round (their
    medians over the rounds), so clock drift during a run reaches every one alike: the
    ratios between them are what the run measures best. The order reverses every other
    round, so no graph always follows the same one (under the power limit the clock a
    graph gets depends on what ran just before it)."""
    times = {k: [] for k in graphs}
    keys = list(graphs)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            times[k].append(replay_us(graphs[k]))
    return {k: _median(v) for k, v in times.items()}


def replay_us(graph, clocks: list | None = None) -> float:
    """µs per call of one replay of ``graph``; with ``clocks``, the SM clock (MHz) read
    while the replay runs is appended to it."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    if clocks is not None:
        clocks.append(sm_clock_mhz())
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / CALLS_PER_GRAPH


_NVML = []


def sm_clock_mhz(index: int = 0):
    """The GPU's current SM clock in MHz through NVML (ctypes, no Python package needed);
    None where NVML is not there."""
    import ctypes

    if not _NVML:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() or lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)):
                raise OSError("NVML init failed")
            _NVML.append((lib, handle))
        except OSError:
            _NVML.append(None)
    if _NVML[0] is None:
        return None
    lib, handle = _NVML[0]
    mhz = ctypes.c_uint()
    return mhz.value if lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)) == 0 else None


def wall_clock(call, reps: int = 30, setup=None) -> float:
    """µs per call outside graphs: CUDA events around the Python call; ``setup`` runs
    before each call, outside the events, its GPU work finished first."""
    for _ in range(3):
        if setup is not None:
            setup()
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return _median(times)


def _implementations(names):
    from ..ops import compress_thd_fused

    def eager(kv, score, ape, cu, cuc, N, ratio, coff):
        return reference.compress_thd(kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff, mode="upstream")

    impls = {}
    if "eager" in names:
        impls["eager"] = eager
    if "compile" in names:
        impls["compile"] = torch.compile(eager, dynamic=False)
    if "fused" in names:
        impls["fused"] = lambda kv, score, ape, cu, cuc, N, ratio, coff: compress_thd_fused(
            kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff)
    if "fused_eager" in names:  # the kernels rounding as the eager region does
        impls["fused_eager"] = lambda kv, score, ape, cu, cuc, N, ratio, coff: compress_thd_fused(
            kv, score, ape, cu, cuc, N, ratio=ratio, coff=coff, numerics="eager")
    if "fused_plan" in names:  # the pack planned once (kernel_api.PoolPlan): no offsets guard
        impls["fused_plan"] = _planned()
    return impls


def _planned():
    from ..pool_plan import PoolPlan

    # an input set's plan, made at its run before capture (capture_graph); the entry holds
    # its offsets tensor, so no other set's can take its id
    plans = {}

    def planned(kv, score, ape, cu, cuc, N, ratio, coff):
        if id(cu) not in plans:
            plans[id(cu)] = cu, PoolPlan(cu, ratio=ratio, coff=coff, head_dim=kv.shape[1] // coff,
                                         dtype=kv.dtype, num_tokens=kv.shape[0], total_comp=N)
        return plans[id(cu)][1].pool(kv, score, ape)
    return planned


def gate(shape, sets, dtype) -> list[str]:
    """Fused vs torch's eager fp32 region (reference mode "fp32") on the first input set
    (forward and gradients)."""
    from ..numerics import compare
    from ..ops import compress_thd_fused

    kv, score, ape, cu, cuc, N, g = sets[0]
    outs = {}
    for name, fn in (("fused", lambda *a: compress_thd_fused(*a[:6], ratio=shape.ratio, coff=shape.coff)),
                     ("fp32", lambda *a: reference.compress_thd(*a[:6], ratio=shape.ratio, coff=shape.coff))):
        leaves = [t.detach().clone().requires_grad_(True) for t in (kv, score, ape)]
        out = fn(*leaves, cu, cuc, N)
        grads = torch.autograd.grad(out, leaves, g)
        outs[name] = (out.detach(), *grads)
    fails = []
    for i, (nm, clause) in enumerate((("out", "ulp"), ("dkv", "bitwise"), ("dscore", "bitwise"),
                                       ("dape", "atol"))):
        f, r = outs["fused"][i], outs["fp32"][i]
        fails += compare(nm, f, r, r, r, clause=clause, against_upstream=False).failures
    return fails


def _git(*args, cwd) -> str:
    return subprocess.check_output(["git", "-C", str(cwd), *args], stderr=subprocess.DEVNULL,
                                   text=True).strip()


def source_commit() -> str:
    """The commit of the checkout this package runs from, with ``-dirty`` when tracked files
    differ from it; ``unknown`` when the package is not in its own git checkout. Asked of
    the package's directory, not the current one: run from a training repository, the
    bench would otherwise label its figures with that repository's commit. A copy of the
    tree over stale git metadata (as the GPU machine's is) reads as dirty, not as the old
    commit; CSA_COMMIT overrides (tools/gpu_call.sh sets it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        top = _git("rev-parse", "--show-toplevel", cwd=here)
        if not os.path.samefile(os.path.join(top, "src", "csa_compressor", "cli", "bench.py"),
                                os.path.abspath(__file__)):
            return "unknown"  # a git repository around an installed copy: not ours
        dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=top)
        return _git("rev-parse", "--short", "HEAD", cwd=top) + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import cutlass

        env["cutlass_dsl"] = cutlass.__version__
    except Exception:
        env["cutlass_dsl"] = None
    env["commit"] = os.environ.get("CSA_COMMIT") or source_commit()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
        try:
            env["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                stderr=subprocess.DEVNULL, text=True).strip().splitlines()[0]
        except Exception:
            env["driver"] = "unknown"
    return env


def input_sets(set_bytes: int, l2_bytes: int) -> int:
    """Copies of a shape's inputs the 20 calls of a graph rotate over: enough that together
    they exceed twice the L2, so no call reads another call's data out of it."""
    return max(1, min(CALLS_PER_GRAPH, math.ceil(2 * l2_bytes / max(set_bytes, 1))))


def run(shapes, dtype=torch.bfloat16, impl_names=("eager", "compile", "fused"), compile_all=False,
        progress=print, same_inputs=False):
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    impls = _implementations(impl_names)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    total = len(shapes) * len(impls)
    done = 0
    for shape in shapes:
        set_bytes = 2 * sum(shape.lens) * shape.coff * shape.d * elem
        n_sets = input_sets(set_bytes, l2)
        if same_inputs:
            n_sets = 1
        sets = [make_inputs(shape, dtype, device, seed=i) for i in range(n_sets)]
        N = sets[0][5]
        fwd_b, all_b = floor_bytes(shape, N, elem)
        gate_fail = gate(shape, sets, dtype) if "fused" in impls else []
        for name, fn in impls.items():
            done += 1
            row = {"shape": shape.name, "impl": name, "N": N, "input_sets": n_sets,
                   "floor_fwd_us": fwd_b / bw * 1e6, "floor_fwdbwd_us": all_b / bw * 1e6}
            if name == "compile" and not compile_all and shape.name not in COMPILE_DEFAULT:
                continue
            progress(f"[{done}/{total}] {shape.name} {name} ...")
            if name == "fused" and gate_fail:
                row["error"] = "correctness gate failed: " + "; ".join(gate_fail)
                rows.append(row)
                continue
            leaves = [[t.detach().clone().requires_grad_(True) for t in s[:3]] for s in sets]

            def fwd(i, fn=fn):
                s = sets[i]
                return fn(*leaves[i], s[3], s[4], N, shape.ratio, shape.coff)

            def fwdbwd(i, fn=fn):
                out = fwd(i)
                return torch.autograd.grad(out, leaves[i], sets[i][6])

            try:
                row["fwd_us"] = time_graph(fwd, n_sets)
                row["fwdbwd_us"] = time_graph(fwdbwd, n_sets)
                row["wall_fwd_us"] = wall_clock(lambda: fwd(0))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwdbwd(0)
                torch.cuda.synchronize()
                row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            except Exception as exc:  # report, never hide
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            for key in ("fwd", "fwdbwd"):
                if f"{key}_us" in row:
                    row[f"{key}_pct_floor"] = 100 * row[f"floor_{key}_us"] / row[f"{key}_us"]
                    row[f"{key}_tbps"] = (fwd_b if key == "fwd" else all_b) / row[f"{key}_us"] / 1e6
            rows.append(row)
        sets = None  # free them before the next shape
        torch.cuda.empty_cache()
    return {"environment": environment(), "copy_bandwidth_tbps": bw / 1e12, "dtype": str(dtype),
            "calls_per_graph": CALLS_PER_GRAPH, "same_inputs": same_inputs, "rows": rows}


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def table(result) -> str:
    head = ("| shape (pack:d:ratio:coff) | impl | fwd µs | fwd+bwd µs | floor fwd / fwd+bwd µs | "
            "% floor fwd / fwd+bwd | TB/s fwd / fwd+bwd | wall fwd µs | peak MiB |")
    lines = [head, "|" + "---|" * 9]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['impl']} | {_fmt(r.get('fwd_us'))} | {_fmt(r.get('fwdbwd_us'))} | "
            f"{_fmt(r['floor_fwd_us'])} / {_fmt(r['floor_fwdbwd_us'])} | "
            f"{_fmt(r.get('fwd_pct_floor'), 0)} / {_fmt(r.get('fwdbwd_pct_floor'), 0)} | "
            f"{_fmt(r.get('fwd_tbps'), 2)} / {_fmt(r.get('fwdbwd_tbps'), 2)} | "
            f"{_fmt(r.get('wall_fwd_us'))} | {_fmt(r.get('peak_mib'))} |")
    return "\n".join(lines)


def header(result) -> str:
    e = result["environment"]
    return (f"GPU {e.get('gpu')}, driver {e.get('driver')}, torch {e['torch']}, CuTe DSL "
            f"{e['cutlass_dsl']}, commit {e['commit']}, {e['date']}; dtype {result['dtype']}; "
            f"measured copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s; "
            f"{result['calls_per_graph']} calls per graph, "
            + ("all on the same inputs (L2-warm where a pack fits)" if result.get("same_inputs")
               else "rotating over inputs of twice the L2"))


def _provenance(result) -> str:
    e = result["environment"]
    return (f"{e.get('gpu')}, driver {e.get('driver')}, torch {e['torch']}, CuTe DSL {e['cutlass_dsl']}, "
            f"commit {e['commit']}, {e['date']}")


def plot(result, out_dir) -> list[str]:
    """PNG plots (needs matplotlib); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "fwd_us" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    files = []
    for key, title in (("fwd", "forward"), ("fwdbwd", "forward + backward")):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / (len(impls) + 1)
        for j, impl in enumerate(impls + ["floor"]):
            xs, ys = [], []
            for i, s in enumerate(shapes):
                r = next((r for r in rows if r["shape"] == s and (r["impl"] == impl or impl == "floor")), None)
                if r is None:
                    continue
                xs.append(i + j * width)
                ys.append(r[f"floor_{key}_us"] if impl == "floor" else r[f"{key}_us"])
            ax.bar(xs, ys, width, label=impl)
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 for i in range(len(shapes))], shapes, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("µs per call (log)")
        ax.set_title(f"{title}, {result['dtype'][6:]}\n{_provenance(result)}", fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"time_{key}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path)
    fig, ax = plt.subplots(figsize=(11, 4))
    for key in ("fwd", "fwdbwd"):
        ys = [next((r.get(f"{key}_pct_floor") for r in rows if r["shape"] == s and r["impl"] == "fused"), 0)
              for s in shapes]
        ax.plot(range(len(shapes)), ys, marker="o", label=f"fused {key}")
    ax.set_xticks(range(len(shapes)), shapes, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("% of memory floor")
    ax.set_title(f"fused, % of the memory floor\n{_provenance(result)}", fontsize=8)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "pct_floor.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    files.append(path)
    return files


def write(result, out_dir, with_json: bool = True) -> list[str]:
    """results.json (unless re-rendering one), results.md and the PNG plots."""
    os.makedirs(out_dir, exist_ok=True)
    files = []
    if with_json:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
        files.append(os.path.join(out_dir, "results.json"))
    text = header(result) + "\n\n" + table(result) + "\n"  # rendered before any file is opened
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    files.append(os.path.join(out_dir, "results.md"))
    try:
        files += plot(result, out_dir)
    except ImportError:
        print('matplotlib missing: no plots (pip install "csa_compressor[bench]", then '
              "csa-compressor report results.json)", file=sys.stderr)
    return files
