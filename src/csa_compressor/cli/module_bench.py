"""`python -m csa_compressor bench --module`: the whole Compressor's training step.

The ``Compressor`` module forward + backward (THD, static capacity, hidden 4096, bf16) at
3x8192 tokens in three configurations, each timed as the op bench times (CUDA graphs of
calls over inputs rotated past the L2; the variants' graphs replayed in turn, round after
round, so the ratios pair their times): the module with one projection GEMM into
``[kv | score]`` (the packed op, its forward the pooling kernel with the epilogue inside),
the same with the epilogue after the pooling kernels (``epilogue_fusion="after"``),
with two projections (the plain op, the layout before) and, as the module was before its
epilogue node, two projections with the epilogue as eager torch ops; with ``numerics="megatron"`` (two projections, Megatron's
roundings in torch ops); the projection GEMMs alone (forward and input + weight
gradients of one GEMM of both weights) as the floor the whole step is measured against;
and the op alone on the projections' output: the pooling with the epilogue inside against
pooling + the epilogue node and pooling + the eager epilogue. Kernel launches a step from torch.profiler.
"""

from __future__ import annotations

import torch

from .bench import CALLS_PER_GRAPH, capture_graph, input_sets, time_graphs_interleaved

HIDDEN = 4096
# (name, head_dim, ratio, rotate)
CONFIGS = (("d512 r4", 512, 4, False), ("d128 r4 rotate", 128, 4, True),
           ("d512 r128", 512, 128, False))


def steps_us(step, n=10, repeats=5) -> float:
    """µs a step outside graphs: the median over ``repeats`` of CUDA events around ``n``
    back-to-back calls of ``step()`` (host time included where it exceeds the GPU's)."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(times)[len(times) // 2]


def profile_steps(step, n=3) -> tuple:
    """(GPU µs, kernel and memory-op launches) a call of ``step()``: torch.profiler's device
    events over ``n`` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.self_device_time_total for e in evs) / n, len(evs) / n


def run(lens=(8192, 8192, 8192), configs=CONFIGS, progress=print, timer=time_graphs_interleaved):
    """One row a config; ``timer`` maps the captured graphs to µs a step each."""
    from ..epilogue import rope_positions
    from ..layout import compressed_cu_seqlens
    from ..module import Compressor

    dev = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    n_sets = input_sets(T * HIDDEN * 2, l2)
    xs = [torch.randn(T, HIDDEN, device=dev).to(torch.bfloat16).requires_grad_(True)
          for _ in range(n_sets)]
    # Every module is built (its random initialisation drawn) before any graph is captured.
    torch.manual_seed(0)
    modules = [Compressor(HIDDEN, d, ratio, rotate=rotate, dtype=torch.bfloat16, device=dev,
                          pooling="fused") for _, d, ratio, rotate in configs]
    rows = []
    for (name, d, ratio, rotate), m in zip(configs, modules):
        params = list(m.parameters())
        with torch.no_grad():
            rows_out = m(xs[0], cu, max_seqlen=max(lens))[0].shape
        # drawn on the host: a failed capture would leave the device generator unusable
        g = torch.randn(rows_out).to(torch.bfloat16).to(dev)
        weight = torch.cat((m.wkv.weight, m.wgate.weight)).detach().requires_grad_(True)
        gk = torch.randn(T, weight.shape[0]).to(torch.bfloat16).to(dev)

        def module_step(i):
            out, _ = m(xs[i], cu, max_seqlen=max(lens))
            return torch.autograd.grad(out, [xs[i]] + params, g)

        def gemm_step(i):
            kvs = torch.nn.functional.linear(xs[i], weight)
            return torch.autograd.grad(kvs, [xs[i], weight], gk)

        with torch.no_grad():
            kvs_in = [m.project(x).detach().requires_grad_(True) for x in xs]
        cuc = compressed_cu_seqlens(cu, ratio)
        cap = rows_out[0]
        pos = rope_positions(cuc, cap, ratio, max(lens))

        def op_step(i):
            pooled = m.pool_packed(kvs_in[i], cu, cuc, cap)
            out = m._finish(pooled, pos)
            return torch.autograd.grad(out, [kvs_in[i], m.ape, m.norm_weight], g)

        def op_in_kernels_step(i):
            out = m.pool_packed(kvs_in[i], cu, cuc, cap, pos=pos)
            return torch.autograd.grad(out, [kvs_in[i], m.ape, m.norm_weight], g)

        row = {"config": name, "tokens": T, "hidden": HIDDEN}
        graphs = {}
        for key, step, one, node, numerics, inside in (
                ("gemms", gemm_step, None, True, "fp32", True),
                ("one_projection", module_step, True, True, "fp32", True),
                ("one_projection_node", module_step, True, True, "fp32", False),
                ("two_projections", module_step, False, True, "fp32", True),
                ("before", module_step, False, False, "fp32", False),
                ("megatron_numerics", module_step, False, True, "megatron", True),
                ("op_in_kernels", op_in_kernels_step, True, True, "fp32", True),
                ("op_node", op_step, True, True, "fp32", False),
                ("op_eager", op_step, True, False, "fp32", False)):
            progress(f"{name} {key} ...")
            if one is not None:
                m.one_projection = one
            # read while the graph captures
            m.numerics = numerics
            m.epilogue_fusion = "inside" if inside else "after" if node else "torch"
            try:
                step(0)  # warm-up
                torch.cuda.synchronize()
                row[f"{key}_loop_us"] = steps_us(lambda: step(0))
                row[f"{key}_launches"] = profile_steps(lambda: step(0), 1)[1]
                graphs[key] = capture_graph(step, n_sets)
            except Exception as exc:  # report, never hide
                row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        m.one_projection, m.numerics, m.epilogue_fusion = True, "fp32", "inside"
        # every variant timed in the same rounds: the step / GEMMs ratio is a paired one
        for key, us in timer(graphs).items():
            row[f"{key}_us"] = us
        del graphs
        progress(str(row))
        rows.append(row)
    return rows


def table(rows) -> str:
    def cell(r, key):
        if f"{key}_us" not in r:
            loop = f"{r[f'{key}_loop_us']:.0f} outside graphs, " if f"{key}_loop_us" in r else ""
            return loop + r.get(f"{key}_error", "-")
        return f"{r[f'{key}_us']:.0f} ({r[f'{key}_launches']:.0f})"

    def ratio(r, a, b):
        return f"{r[f'{a}_us'] / r[f'{b}_us']:.2f}x" if f"{a}_us" in r and f"{b}_us" in r else "-"

    lines = ["| config | module µs (kernels) | epilogue after the pooling kernels | two "
             "projections | two projections, eager epilogue (the module before) | "
             "numerics=\"megatron\" | projection GEMMs alone | step / GEMMs | pooling with the "
             "epilogue inside | pooling + epilogue node | pooling + eager epilogue |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {cell(r, 'one_projection')} | "
                     f"{cell(r, 'one_projection_node')} | "
                     f"{cell(r, 'two_projections')} | {cell(r, 'before')} | "
                     f"{cell(r, 'megatron_numerics')} | {cell(r, 'gemms')} | "
                     f"{ratio(r, 'one_projection', 'gemms')} | {cell(r, 'op_in_kernels')} | "
                     f"{cell(r, 'op_node')} | {cell(r, 'op_eager')} |")
    return "\n".join(lines)


def header(env, rows) -> str:
    T = rows[0]["tokens"] if rows else 0
    return (f"GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env['torch']}, CuTe DSL "
            f"{env['cutlass_dsl']}, commit {env['commit']}, {env['date']}; Compressor forward + "
            f"backward, {T} tokens (3 sequences), hidden {HIDDEN}, bf16; {CALLS_PER_GRAPH} steps "
            "per CUDA graph over inputs rotated past the L2")
