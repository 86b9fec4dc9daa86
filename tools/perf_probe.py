"""Developer probe (H200): where the host time of a fused call goes, and an A/B sweep of the
kernel-shaping constants. Not part of the package; docs/lab/ceilings.md summarises what it measured.

    python tools/perf_probe.py host
    python tools/perf_probe.py validate
    python tools/perf_probe.py sweep ['K=V,K=V;K=V' [shape,shape]]
    python tools/perf_probe.py floor
    python tools/perf_probe.py parts [shape,shape]
    [SETS=1] python tools/perf_probe.py reads [shape,shape]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import os
import subprocess
import sys

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from csa_compressor.cli import bench
from csa_compressor import testing, compress_thd_fused
from csa_compressor.kernel_api import pool_backward, pool_forward
from csa_compressor.kernels import compile as cc
from csa_compressor.kernels import tuning
from csa_compressor.validation import validate


def _host_cases(spec):
    """Each layer of a forward call on pack ``spec`` (bf16, d=128, ratio 4, coff 2), from a
    bare allocation up to compress_thd_fused with grad, as zero-argument calls."""
    from csa_compressor.kernels.launch import on_device
    from csa_compressor.checks import check_out

    shape = testing.parse_shape(spec)
    kv, score, ape, cu, cuc, N, _ = testing.make_inputs(shape, torch.bfloat16, torch.device("cuda"))
    out = torch.empty(N, 128, dtype=torch.bfloat16, device="cuda")
    dev = kv.device
    pool_forward(kv, score, ape, cu, cuc, out, ratio=4, coff=2)  # compiles
    c = cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128)
    fn = c.fn
    from csa_compressor.kernels.launch import sm_count
    rows = c.kernel.rows_per_thread(N, sm_count(dev.index), c.ctas_per_sm)  # launch_forward's
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    g = torch.randn(N, 128, device="cuda").to(torch.bfloat16)
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    pool_backward(kv, score, ape, cu, cuc, g, *grads, ratio=4, coff=2)  # compiles
    x = leaves[0]

    def op_step():  # the measure: a forward plus torch.autograd.grad
        y = compress_thd_fused(*leaves, cu, cuc, N, ratio=4, coff=2)
        torch.autograd.grad(y, leaves, g)

    def trivial_step():  # a bare autograd step on the same host: (x*2).sum() and its grad
        torch.autograd.grad((x * 2).sum(), (x,))

    def guard():
        with on_device(dev):
            pass

    return {
        "torch.empty (no kernel)": lambda: torch.empty(N, 128, dtype=torch.bfloat16, device="cuda"),
        "validate(for_kernel)": lambda: validate(kv, score, ape, cu, cuc, N, ratio=4, coff=2, for_kernel=True),
        "check_out": lambda: check_out("out", out, (N, 128), torch.bfloat16, dev),
        "get_kernel (cache hit)": lambda: cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128),
        "device guard (current device)": guard,
        "launch (get_kernel's tvm_ffi.Function)": lambda: fn(kv, score, ape, cu, cuc, out, rows),
        "pool_forward": lambda: pool_forward(kv, score, ape, cu, cuc, out, ratio=4, coff=2),
        "compress_thd_fused (no grad)": lambda: compress_thd_fused(kv, score, ape, cu, cuc, N, ratio=4, coff=2),
        "compress_thd_fused (requires grad)": lambda: compress_thd_fused(*leaves, cu, cuc, N, ratio=4, coff=2),
        "pool_backward": lambda: pool_backward(kv, score, ape, cu, cuc, g, *grads, ratio=4, coff=2),
        "forward + autograd.grad (compress_thd_fused)": op_step,
        "trivial autograd step ((x*2).sum(), grad)": trivial_step,
    }


def host():
    print("CUDA events around each call (the issue's wall-clock method), 1x8192:128:4:2:")
    for name, f in _host_cases("1x8192:128:4:2").items():
        print(f"{name:40s} {bench.wall_clock(f, reps=200):8.1f} µs")
    host_loop()


def host_loop():
    """Host time per call of each layer: perf_counter over back-to-back calls, one sync at
    the end. A 64-row pack keeps each kernel (~2-3 µs) shorter than the host path, so the
    GPU does not pace the loop; an event pair costs nothing here."""
    import time

    print("host µs per call, perf_counter over 2000 back-to-back calls, 1x256:128:4:2:")
    for name, f in _host_cases("1x256:128:4:2").items():
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(2000):
                f()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 2000 * 1e6)
        print(f"{name:40s} {best:8.2f} µs")


def validate_cost():
    """Host cost of validate() on CPU tensors (runs anywhere; the H200 figure is `host`)."""
    import timeit
    kv = torch.randn(8192, 256, dtype=torch.bfloat16)
    score, ape = kv.clone(), torch.randn(4, 256)
    cu = torch.tensor([0, 8192], dtype=torch.int32)
    cuc = torch.tensor([0, 2048], dtype=torch.int32)
    f = lambda: validate(kv, score, ape, cu, cuc, 2048, ratio=4, coff=2)  # noqa: E731
    n = 50000
    print(f"validate (CPU tensors) {min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6:.1f} µs")


def floor():
    """The fixed cost under the bench's method: graphs of 20 calls of 1-3 one-element
    kernels (what any launch costs there), then the fused op on packs with almost no work
    (what our kernels cost before bytes matter)."""
    x = torch.zeros(1, device="cuda")
    for k in (1, 2, 3):
        def step(_, k=k):
            for _ in range(k):
                x.add_(1.0)
        print(f"{k} one-element kernel(s) a call: {bench.time_graph(step, 1):6.2f} µs")
    shapes = [testing.parse_shape(s) for s in ("1x4:128:4:2", "1x64:128:4:2", "1x1024:128:4:2")]
    for row in bench.run(shapes, torch.bfloat16, ("fused",), progress=lambda m: None)["rows"]:
        print(row["shape"], f"fwd {row.get('fwd_us', float('nan')):.2f} µs "
              f"fwd+bwd {row.get('fwdbwd_us', float('nan')):.2f} µs", row.get("error", ""))


def parts():
    """Each launch of a fused step on its own, timed as the bench times a step (graphs of
    20 calls over the same rotating input sets): the forward (pool_forward), the backward
    kernel without its dape sum (launched as launch_backward launches it), the dape sum
    alone (on the partials the backward left), the backward with its sum (pool_backward)
    and the whole kernel-level step. What a step costs over
    the sum of its parts is what the launches do not overlap. The backward kernel is also
    timed with its row CTAs alone and its zero-fill CTAs alone (the same launch with the
    other count 0: timing only, the gradients are then incomplete), which splits, e.g., the
    2048x64 pack's backward against 1x131072's."""

    from csa_compressor.kernels import launch

    names = sys.argv[2].split(",") if len(sys.argv) > 2 else (
        "1x8192:128:4:2", "3x8192:128:4:2", "1x8192:512:4:2", "3x8192:512:4:2",
        "[1023,2048,509,3,0,77]:128:4:2")
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name in names:
        shape = testing.parse_shape(name)
        r, c, d = shape.ratio, shape.coff, shape.d
        set_bytes = 4 * sum(shape.lens) * c * d
        n = bench.input_sets(set_bytes, l2)
        sets = [testing.make_inputs(shape, torch.bfloat16, dev, seed=i) for i in range(n)]
        N, T = sets[0][5], sets[0][0].shape[0]
        outs = [torch.empty(N, d, dtype=torch.bfloat16, device=dev) for _ in sets]
        grads = [(torch.empty_like(s[0]), torch.empty_like(s[1]), torch.empty_like(s[2])) for s in sets]
        cb, (rpc, row_ctas, zero_ctas), ws = launch.backward_plan(
            dev, torch.bfloat16, r, c, d, N, T)
        fb = cb.fn
        works = [torch.empty(ws, device=dev) for _ in sets]

        def fwd(i):
            kv, score, ape, cu, cuc = sets[i][:5]
            pool_forward(kv, score, ape, cu, cuc, outs[i], ratio=r, coff=c)

        def bwd_kernel(rows, zeros):
            """The backward kernel alone (as launch_backward launches it), with ``rows`` row
            CTAs and ``zeros`` zero-fill CTAs."""
            def launch_it(i):
                kv, score, ape, cu, cuc, _, g = sets[i]
                fb(kv, score, ape, cu, cuc, g, grads[i][0], grads[i][1], works[i], rpc, rows,
                   zeros)
            return launch_it

        def dape_only(i):
            C = grads[i][2].numel()
            launch.dape_sum(cb, row_ctas)(works[i].view(row_ctas, C), grads[i][2].view(1, C))

        def bwd(i):
            kv, score, ape, cu, cuc, _, g = sets[i]
            pool_backward(kv, score, ape, cu, cuc, g, *grads[i], ratio=r, coff=c,
                          workspace=works[i])

        def step(i):
            fwd(i)
            bwd(i)

        for i in range(n):
            bwd(i)  # the partials dape_only sums
        cells = [f"{k} {bench.time_graph(f, n):6.2f}" for k, f in (
            ("fwd", fwd), ("bwd kernel", bwd_kernel(row_ctas, zero_ctas)),
            ("its rows", bwd_kernel(row_ctas, 0)), ("its zeros", bwd_kernel(0, zero_ctas)),
            ("dape sum", dape_only),
            ("bwd+dape", bwd), ("fwd+bwd+dape", step))]
        print(f"{name:32s} sets {n:2d} row CTAs {row_ctas:4d} zero CTAs {zero_ctas:5d} | "
              + " | ".join(cells) + " µs")
        sets = outs = grads = works = None  # free them before the next shape
        torch.cuda.empty_cache()


def sweep():
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else (
        "1x8192:128:4:2", "3x8192:512:4:2", "[1023,2048,509,3,0,77]:128:4:2")
    variants = [dict(FWD_STAGES=3, FWD_MAX_ROWS_PER_THREAD=8, FWD_TARGET_CTAS_PER_SM=4),
                dict(FWD_STAGES=2, FWD_MAX_ROWS_PER_THREAD=8, FWD_TARGET_CTAS_PER_SM=4),
                dict(FWD_STAGES=4, FWD_SMEM_PER_CTA=65536, FWD_MAX_ROWS_PER_THREAD=8, FWD_TARGET_CTAS_PER_SM=4),
                dict(FWD_STAGES=3, FWD_MAX_ROWS_PER_THREAD=4, FWD_TARGET_CTAS_PER_SM=4),
                dict(FWD_STAGES=3, FWD_MAX_ROWS_PER_THREAD=16, FWD_TARGET_CTAS_PER_SM=2)]
    if len(sys.argv) > 2:  # e.g. 'FWD_STAGES=2,FWD_MAX_ROWS_PER_THREAD=4;FWD_STAGES=3'
        variants = [tuning.parse_overrides(v) for v in sys.argv[2].split(";")]
    for v in variants:
        # Each variant in its own process: the tuning is CSA_CONFIG's, read at import.
        env = dict(os.environ, CSA_CONFIG=",".join(f"{k}={x}" for k, x in v.items()))
        subprocess.run([sys.executable, __file__, "sweep_one", str(v), ",".join(names)],
                       env=env, check=True)


def sweep_one():
    v, shapes = sys.argv[2], [testing.parse_shape(s) for s in sys.argv[3].split(",")]
    dtype = getattr(torch, os.environ.get("SWEEP_DTYPE", "bfloat16"))  # e.g. float32
    r = bench.run(shapes, dtype, ("fused",), progress=lambda m: None)
    for row in r["rows"]:
        print(v, row["shape"], f"fwd {row.get('fwd_us', float('nan')):.1f} µs "
                  f"fwd+bwd {row.get('fwdbwd_us', float('nan')):.1f} µs", row.get("error", ""))


class _ReadStream:
    """A read-only streaming kernel for reads(): each thread loads 16-byte vectors over a
    grid-stride loop (``unroll`` loads in flight), adds them into one word and stores that
    word (writes 1/n of the reads): what reading n bytes costs under the bench's method.
    Launched as a programmatic dependent, as our kernels are."""

    def __init__(self, threads=256, unroll=4):
        self.threads, self.unroll = threads, unroll

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, ctas: Int32, stream):
        self.kernel(cute.zipped_divide(mX, (4,)), mY).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, gX: cute.Tensor, mY: cute.Tensor):
        cute.arch.griddepcontrol_wait()
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        gd, _, _ = cute.arch.grid_dim()
        n = cute.size(gX, mode=[1])
        i0 = bx * self.threads + tid
        acc = Int32(0)
        for i in cutlass.range(i0, n, gd * self.threads, unroll=self.unroll):
            v = gX[(None, i)].load()
            acc = acc + Int32(v[0] ^ v[1] ^ v[2] ^ v[3])
        mY[i0] = acc


def reads():
    """What plain streaming kernels reach on each shape's forward bytes, timed as the bench
    times (graphs of 20 calls over rotating sets): a read-only stream of the same bytes
    (_ReadStream, 4-16 loads in flight a thread at 1-8 CTAs an SM: the best), the same
    bytes copied by torch (half read, half written, as the copy ceiling's memcpy moves
    them) and our forward; then the same for a forward + backward step's bytes. The floor
    divides bytes by the memcpy bandwidth of 1 GiB outside graphs."""

    from csa_compressor.kernels.compile import _compile, _direct
    from csa_compressor.kernels.plan import _fake

    names = sys.argv[2].split(",") if len(sys.argv) > 2 else (
        "1x8192:128:4:2", "3x8192:128:4:2", "1x8192:512:4:2", "3x8192:512:4:2",
        "1023+2048+509+3+0+77:128:4:2")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = bench.copy_bandwidth(dev)
    print(f"copy bandwidth (memcpy, outside graphs): {bw / 1e12:.2f} TB/s")
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    L, M = cute.sym_int32(), cute.sym_int32()
    kern = _ReadStream()  # sink sizing: threads a CTA
    rds = {u: _direct(_compile(_ReadStream(unroll=u), _fake(cutlass.Int32, (L,), 16),
                               _fake(cutlass.Int32, (M,), 4), Int32(1), stream))
           for u in (4, 8, 16)}
    for name in names:
        shape = testing.parse_shape(name)
        T, W = sum(shape.lens), shape.coff * shape.d
        sets = [testing.make_inputs(shape, torch.bfloat16, dev, seed=0)]
        N = sets[0][5]
        fwd_bytes = 2 * T * W * 2 + N * shape.d * 2
        n = bench.input_sets(fwd_bytes, l2)
        # SETS=1: every call of a graph on the same inputs (L2-warm where they fit),
        # against the bench's rotation over sets of twice the L2.
        n = int(os.environ.get("SETS", n))
        sets += [testing.make_inputs(shape, torch.bfloat16, dev, seed=i) for i in range(1, n)]
        outs = [torch.empty(N, shape.d, dtype=torch.bfloat16, device=dev) for _ in sets]
        words = -(-fwd_bytes // 16) * 4
        xs = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=dev) for _ in range(n)]
        ys = [torch.empty(words // 2, dtype=torch.int32, device=dev) for _ in range(n)]
        sink = torch.empty(8 * sms * kern.threads, dtype=torch.int32, device=dev)

        def fwd(i):
            kv, score, ape, cu, cuc = sets[i][:5]
            pool_forward(kv, score, ape, cu, cuc, outs[i], ratio=shape.ratio, coff=shape.coff)

        def copy(i):
            ys[i].copy_(xs[i][: ys[i].numel()])

        floor = fwd_bytes / bw * 1e6
        best = min((bench.time_graph(lambda i, c=c, rd=rd: rd(xs[i], sink, c * sms), n), c, u)
                   for c in (1, 2, 4, 8) for u, rd in rds.items())
        for label, us in ((f"read-only stream ({best[1]} CTAs an SM, {best[2]} loads in flight)",
                           best[0]),
                          ("torch copy", bench.time_graph(copy, n)),
                          ("pool_forward", bench.time_graph(fwd, n))):
            print(f"{name} {fwd_bytes / 1e6:.1f} MB {label}: {us:.2f} µs "
                  f"({fwd_bytes / us / 1e6:.2f} TB/s; floor {floor:.2f} µs)", flush=True)

        # The step: our kernel-level forward + backward against three streaming launches
        # over the same bytes: the read stream over a buffer of kv and score's bytes (the
        # forward's reads), a torch copy of that same buffer (the backward reads kv and score
        # again, from L2 where they stayed, and writes dkv and dscore), the read stream over
        # twice grad_out's bytes (the forward's output written, grad_out read). Three
        # launches, as ours (forward, backward, dape sum).
        step_bytes = bench.floor_bytes(shape, N, 2)[1]
        wb, gb = -(-2 * T * W * 2 // 16) * 16, 2 * N * shape.d * 2
        srcs = [torch.empty(wb, dtype=torch.uint8, device=dev) for _ in range(n)]
        dsts = [torch.empty_like(x) for x in srcs]
        gws = [torch.randint(0, 1 << 30, (-(-gb // 16) * 4,), dtype=torch.int32, device=dev)
               for _ in range(n)]
        grads = [(torch.empty_like(s[0]), torch.empty_like(s[1]), torch.empty_like(s[2]))
                 for s in sets]
        rd, c = rds[best[2]], best[1] * sms

        def ceiling_step(i):
            rd(srcs[i].view(torch.int32), sink, c)
            dsts[i].copy_(srcs[i])
            rd(gws[i], sink, c)

        def apart_step(i):
            """The same with the first read over a buffer of its own (no L2 reuse between
            the forward's reads and the backward's): what that reuse is worth."""
            rd(xs[i], sink, c)
            dsts[i].copy_(srcs[i])
            rd(gws[i][: gws[i].numel() // 2], sink, c)

        def our_step(i):
            kv, score, ape, cu, cuc, _, g = sets[i]
            pool_forward(kv, score, ape, cu, cuc, outs[i], ratio=shape.ratio, coff=shape.coff)
            pool_backward(kv, score, ape, cu, cuc, g, *grads[i], ratio=shape.ratio,
                          coff=shape.coff)

        step_floor = step_bytes / bw * 1e6
        for label, f in (("step: read, copy, read", ceiling_step),
                         ("step: read, copy, read, separate buffers", apart_step),
                         ("step: pool_forward + pool_backward", our_step)):
            us = bench.time_graph(f, n)
            print(f"{name} {step_bytes / 1e6:.1f} MB {label}: {us:.2f} µs "
                  f"({step_bytes / us / 1e6:.2f} TB/s; floor {step_floor:.2f} µs)", flush=True)
        sets = outs = xs = ys = srcs = dsts = gws = grads = None  # freed before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {"host": host, "sweep": sweep, "sweep_one": sweep_one, "validate": validate_cost, "floor": floor,
     "parts": parts, "reads": reads}[sys.argv[1]]()
