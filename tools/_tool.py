"""What every tool here does first: answer ``--help`` with its docstring, and where it
needs a GPU, say so and exit 2 on a machine without one (before importing the package)."""

import sys

NO_GPU = 2


def start(doc: str, gpu: bool = True, own_help: bool = False) -> None:
    """``own_help``: the tool parses its arguments itself (argparse answers ``--help``)."""
    asked = any(a in ("-h", "--help") for a in sys.argv[1:])
    if asked and not own_help:
        print((doc or "").strip())
        sys.exit(0)
    if gpu and not asked:
        import torch

        if not torch.cuda.is_available():
            name = sys.argv[0].rsplit("/", 1)[-1]
            print(f"{name}: needs a CUDA GPU (compute capability 9.0 or newer); none is "
                  "available here", file=sys.stderr)
            sys.exit(NO_GPU)


def host_us(fn, calls: int, sync=None, warm: int = 5, rounds: int = 3) -> float:
    """Host µs a call of ``fn``: the best of ``rounds`` batches of ``calls`` back-to-back
    calls, ``sync()`` (e.g. torch.cuda.synchronize) after the warm-up and after each batch,
    never inside one."""
    import time

    sync = sync or (lambda: None)
    for _ in range(warm):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        sync()
    return best


def print_cprofile(fn, calls: int, sync=None, shown=(30, 30)) -> None:
    """cProfile of ``calls`` back-to-back calls of ``fn`` (``sync()`` after them, outside
    the profile), printed by own time, then by cumulative time (``shown`` rows each)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    (sync or (lambda: None))()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(shown[0])
    st.sort_stats("cumulative").print_stats(shown[1])


def kernel_table(prof, steps: int, digits: int = 1) -> tuple:
    """torch.profiler ``prof``'s CUDA kernels grouped by name (cut to 90 characters), a step
    of ``steps``: (µs a step, launches a step, a markdown table of each kernel's launches
    and µs a step, the largest first, µs to ``digits`` decimals)."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    groups = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            k = e.name if len(e.name) < 90 else e.name[:87] + "..."
            groups[k][0] += 1
            groups[k][1] += e.self_device_time_total
    lines = ["| kernel | launches a step | µs a step |", "|---|---|---|"]
    for k, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{k}` | {n / steps:g} | {us / steps:.{digits}f} |")
    return (sum(v[1] for v in groups.values()) / steps,
            sum(v[0] for v in groups.values()) / steps, "\n".join(lines))


def floor_step(launch, kvs, ape, g_rows):
    """The packed op's training step reduced to the floor of its design: a Python
    autograd.Function (a non-tensor first argument, as the op's problem) with the op's five
    allocations (the guarded APE and the rows, then dkvs, dape and the dape partials) and
    four ``launch(tensor)`` calls in place of its launches (the offsets guard, the forward,
    the backward, the dape sum), no validation, no plans. Returns the step: the rows'
    forward and ``torch.autograd.grad`` of ``kvs``."""
    import torch

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, a, k):
            ctx.save_for_backward(k, a)
            launch(torch.empty_like(a))
            out = torch.empty(g_rows.shape, device=k.device, dtype=k.dtype)
            launch(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            k, a = ctx.saved_tensors
            dk, da = torch.empty_like(k), torch.empty_like(a)
            launch(torch.empty((64, a.numel()), device=k.device))
            launch(da)
            return None, da, dk

    def step():
        k = kvs.detach().requires_grad_(True)
        torch.autograd.grad(Floor.apply(None, ape, k), k, g_rows)

    return step
