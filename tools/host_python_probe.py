"""Developer probe for any machine (no GPU): the Python share of the op layer's host time,
with every launch a no-op. The kernels' launch designs are the real ones (built, never
compiled) and the tensors live on the CPU, so what is timed is the package's own work
around the launches (checks, problem values, plans, autograd glue, allocations), not the
driver's. A regression guard for the host figures that tools/op_host_profile.py and
tools/launch_host_probe.py measure on a GPU host, where each launch adds its own cost.
Also a streaming prefill into empty slots, its offsets and tail kernels stood in.

    python tools/host_python_probe.py [calls]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import _tool  # noqa: E402
from _tool import start  # noqa: E402

start(__doc__, gpu=False)

import sys
from contextlib import ExitStack
from unittest import mock

import torch


def stubbed(stack, launches: list):
    """Launches as no-ops on CPU tensors, each appended to ``launches``: the pooling
    families and the offsets guard stood in (kernels.compile.stand_in, jit.stand_in_small),
    and validation past its CUDA-only checks (device, alignment). Returns the function
    that stands in a spec's family."""
    from csa_compressor import dispatch, kernel_api, ops, pooling, validation
    from csa_compressor.kernels import compile as cc, jit, launch

    cpu = torch.device("cpu")

    def noop(*a):
        launches.append(len(a))

    def any_device(fn):
        # CPU tensors, whose offsets validation would read: on a GPU it reads none
        def wrapped(*a, for_kernel=False, contents=True, **k):
            return fn(*a, contents=False, **k)
        return wrapped

    stack.enter_context(mock.patch.object(launch, "sm_count", lambda index: 132))
    for mod, name in ((ops, "validate_packed"), (ops, "validate"), (dispatch, "validate"),
                      (pooling, "validate_packed"), (kernel_api, "validate")):
        stack.enter_context(mock.patch.object(mod, name, any_device(getattr(validation, name))))
    for ratio in (1, 2, 4, 8, 128):
        stack.enter_context(jit.stand_in_small(("offsets_guard", ratio), cpu, noop))
    return lambda spec: stack.enter_context(cc.stand_in(spec, cpu, noop))


def _scratch_staging():
    """A stream state's Staging with a stand-in runtime: its scratch twins as a GPU's."""
    from csa_compressor.streaming.uploads import PinnedRing, Staging

    class Runtime:
        def current(self):
            return True

        def stream(self):
            return 1

    raw = Runtime()
    return Staging(torch.device("cpu"), raw=raw, ring=PinnedRing(raw, pinned=False))


def host_us(fn, calls):
    return _tool.host_us(fn, calls, warm=20, rounds=5)


def main(calls=2000):
    from csa_compressor import compress_thd_fused_packed
    from csa_compressor import pool_plan
    from csa_compressor.kernel_api import PoolPlan, pool_backward, pool_forward
    from csa_compressor.kernels import plan

    with ExitStack() as stack:
        launches = []
        fill = stubbed(stack, launches)
        d, ratio, coff, T = 128, 4, 2, 64  # small: a CPU allocation of megabytes maps pages
        for direction, rs in (("fwd", 0), ("bwd", 0), ("fwd", 2 * coff * d),
                              ("bwd", 2 * coff * d)):  # separate and packed rows
            fill(plan.spec(direction, torch.bfloat16, ratio, coff, d, row_stride=rs))
        cu = torch.tensor([0, T], dtype=torch.int32)
        cuc = torch.tensor([0, T // ratio], dtype=torch.int32)
        n = T // ratio
        kvs = torch.zeros(T, 2 * coff * d, dtype=torch.bfloat16)
        ape = torch.zeros(ratio, coff * d)
        g_rows = torch.zeros(n, d, dtype=torch.bfloat16)
        small = torch.zeros(64, requires_grad=True)
        g_small = torch.zeros(64)
        kv, score = kvs[:, :coff * d].contiguous(), kvs[:, coff * d:].contiguous()
        bufs = [torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)]
        out = torch.empty(n, d, dtype=torch.bfloat16)
        # the plan's runs: a CPU plan (its device check passed over)
        stack.enter_context(mock.patch.object(pool_plan, "check_cuda_device", lambda dev: cpu))
        stack.enter_context(mock.patch.object(pool_plan, "sm_count", lambda index: 132))
        cpu = torch.device("cpu")
        planned = PoolPlan([0, T], ratio=ratio, coff=coff, head_dim=d, dtype=torch.bfloat16)

        def op_step():
            k = kvs.detach().requires_grad_(True)
            rows = compress_thd_fused_packed(k, ape, cu, cuc, n, ratio=ratio, coff=coff)
            torch.autograd.grad(rows, k, g_rows)

        def plan_step():
            k = kvs.detach().requires_grad_(True)
            torch.autograd.grad(planned.pool_packed(k, ape), k, g_rows)

        # the step's design without the package's Python (op_host_profile's floor row)
        floor_step = _tool.floor_step(lambda t: launches.append(1), kvs, ape, g_rows)

        # streaming: a prefill into 8 empty slots (chunks._fresh), the tail kernel stood in
        from csa_compressor import runtime, streaming
        from csa_compressor.streaming import ring

        stack.enter_context(mock.patch.object(runtime, "device_reason", lambda device: None))
        stack.enter_context(mock.patch.object(ring, "tail_launcher",
                                              lambda st, kv, sc: lambda *a: launches.append(a)))
        # the offsets kernel's launch into a scratch twin, as on a GPU (a runtime stand-in)
        stack.enter_context(mock.patch.object(ring, "offsets_launcher",
                                              lambda st, B: (lambda *a: launches.append(a), 8)))
        B = 8
        state = streaming.StreamState(B, d, ratio=ratio, coff=coff, dtype=torch.bfloat16)
        stg = _scratch_staging()
        stack.enter_context(mock.patch.object(streaming.StreamState, "staging", lambda self: stg))
        chunk = torch.zeros(B * T, coff * d, dtype=torch.bfloat16)
        cu_host, slots = [b * T for b in range(B + 1)], list(range(B))

        def prefill():
            state.host_counts = [0] * B  # empty again, as the host records it
            return streaming.prefill(state, chunk, chunk, ape, cu_host, slots)

        rows = [
            ("autograd.grad of a torch mul (CPU)", lambda: torch.autograd.grad(
                small * 2, small, g_small)),
            ("packed op fwd + autograd.grad", op_step),
            ("floor: a Python Function with the op's allocations", floor_step),
            ("packed op, no grad", lambda: compress_thd_fused_packed(
                kvs, ape, cu, cuc, n, ratio=ratio, coff=coff)),
            ("kernel API pool_forward", lambda: pool_forward(
                kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)),
            ("kernel API pool_backward", lambda: pool_backward(
                kv, score, ape, cu, cuc, g_rows, *bufs, ratio=ratio, coff=coff)),
            ("packed op through a PoolPlan, fwd + autograd.grad", plan_step),
            ("PoolPlan.forward", lambda: planned.forward(kv, score, ape, out)),
            ("PoolPlan.backward", lambda: planned.backward(kv, score, ape, g_rows, *bufs)),
            ("streaming prefill into 8 empty slots", prefill),
        ]
        got = {}
        for name, fn in rows:
            got[name] = host_us(fn, calls)
            launches.clear()
            fn()
            print(f"{got[name]:8.1f} µs  {name} ({len(launches)} launches)")
        step, floor = got["packed op fwd + autograd.grad"], got["floor: a Python Function with the op's allocations"]
        share = step - got["autograd.grad of a torch mul (CPU)"]
        print(f"the op's Python share of fwd + autograd.grad, launches stubbed: {share:.1f} µs, "
              f"{step - floor:.1f} above the floor of its design")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
