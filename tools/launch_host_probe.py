"""Host µs a call of the pieces of the Compressor module's step outside CUDA graphs: torch's
own launches, the package's small-kernel launches (TVM-FFI), its dispatch checks, the
pooling op, the epilogue op, the module's forward and its step, at the module bench's
d128 rotate config. Each piece is called back to back (no sync inside a batch), so the
figure is what the host spends, not the GPU.

    python tools/launch_host_probe.py [calls]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import _tool  # noqa: E402
from _tool import start  # noqa: E402

start(__doc__, gpu=True)
import sys
import threading

import torch
from csa_compressor import runtime

from module_profile import HIDDEN, LENS, inputs, module_step


def host_us(fn, calls):
    return _tool.host_us(fn, calls, torch.cuda.synchronize)


def main(calls=100):
    from csa_compressor import (Epilogue, apply_epilogue, compress_thd_fused_packed,
                                pool_backward)
    from csa_compressor.epilogue import rope_cos_sin, rope_inv_freq, rope_positions
    from csa_compressor.kernels.offsets import compressed_offsets
    from csa_compressor.layout import compressed_capacity, compressed_cu_seqlens

    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"__dlpack_c_exchange_api__: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
    x, cu = inputs(dev)
    d, ratio, coff = 128, 4, 2
    cuc = compressed_cu_seqlens(cu, ratio)
    n = compressed_capacity(x.shape[0], len(LENS), max(LENS), ratio)
    w = torch.randn(2 * coff * d, HIDDEN, device=dev, dtype=torch.bfloat16)
    kvs = torch.nn.functional.linear(x.detach(), w)
    ape = torch.randn(ratio, coff * d, device=dev)
    pooled = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ep = Epilogue(rope_dim=64, rotate=True)
    inv = rope_inv_freq(64, ep.rope_theta, None, device=dev)
    pos = rope_positions(cuc, n, ratio, max(LENS))
    g_rows = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    xd = x.detach()
    g_kvs = torch.randn_like(kvs)

    def pool_step():
        k = kvs.detach().requires_grad_(True)
        out = compress_thd_fused_packed(k, ape, cu, cuc, n, ratio=ratio, coff=coff)
        torch.autograd.grad(out, k, g_rows)

    def epilogue_step():
        out = apply_epilogue(pooled, weight, pos, ep, inv_freq=inv)
        torch.autograd.grad(out, (pooled, weight), g_rows)

    def gemms():
        torch.nn.functional.linear(xd, w)
        g_kvs.mm(w)
        g_kvs.t().mm(xd)

    kv, score = kvs[:, :coff * d].contiguous(), kvs[:, coff * d:].contiguous()
    bufs = [torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)]

    def pool_backward_direct():
        pool_backward(kv, score, ape, cu, cuc, g_rows, *bufs, ratio=ratio, coff=coff)

    from csa_compressor.kernel_api import pool_forward

    rows_out = torch.empty(n, d, device=dev, dtype=torch.bfloat16)

    def pool_forward_direct():
        pool_forward(kv, score, ape, cu, cuc, rows_out, ratio=ratio, coff=coff)

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class OffsetsInBackward(Twice):
        @staticmethod
        def backward(ctx, g):
            compressed_offsets(cu, ratio)
            return Twice.backward(ctx, g)

    small = torch.randn(64, device=dev, requires_grad=True)
    g_small = torch.randn(64, device=dev)

    def in_thread(fn):
        box = []

        def work():
            torch.cuda.set_device(torch.cuda.current_device())
            box.append(host_us(fn, calls))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        return box[0]

    rows = [
        ("autograd.grad of a torch mul", lambda: torch.autograd.grad(small * 2, small, g_small)),
        ("autograd.grad of a torch mul (Python Function)", lambda: torch.autograd.grad(
            Twice.apply(small), small, g_small)),
        ("autograd.grad, the backward also launches compressed_offsets", lambda: torch.autograd.grad(
            OffsetsInBackward.apply(small), small, g_small)),
        ("pool_forward (kernel API, main thread)", pool_forward_direct),
        ("pool_backward (kernel API, main thread)", pool_backward_direct),
        ("torch.empty_like (no launch)", lambda: torch.empty_like(cu)),
        ("torch add (one launch)", lambda: cu.add(1)),
        ("runtime.small_kernels_usable", lambda: runtime.small_kernels_usable(cu)),
        ("runtime.device_reason", lambda: runtime.device_reason(dev)),
        ("kernels.offsets.compressed_offsets (alloc + launch)", lambda: compressed_offsets(cu, ratio)),
        ("layout.compressed_cu_seqlens", lambda: compressed_cu_seqlens(cu, ratio)),
        ("epilogue.rope_positions", lambda: rope_positions(cuc, n, ratio, max(LENS))),
        ("epilogue.rope_cos_sin", lambda: rope_cos_sin(pos, ep, inv)),
        ("compress_thd_fused_packed, no grad", lambda: compress_thd_fused_packed(
            kvs, ape, cu, cuc, n, ratio=ratio, coff=coff)),
        ("compress_thd_fused_packed fwd + bwd", pool_step),
        ("apply_epilogue fwd + bwd", epilogue_step),
        ("the step's three GEMMs", gemms),
    ]
    step = module_step("d128r4rot", x, cu)
    got = {}
    for name, fn in rows:
        got[name] = host_us(fn, calls)
        print(f"{got[name]:8.1f} µs  {name}")
    # the op layer's host targets (issue 47), from the rows above
    bare = got["kernels.offsets.compressed_offsets (alloc + launch)"]
    print(f"\nkernel API against one TVM-FFI launch (alloc + launch, {bare:.1f} µs; target "
          f"2x): forward {got['pool_forward (kernel API, main thread)'] / bare:.1f}x, backward "
          f"{got['pool_backward (kernel API, main thread)'] / bare:.1f}x")
    share = got["compress_thd_fused_packed fwd + bwd"] - got["autograd.grad of a torch mul"]
    print(f"the op's own share of fwd + autograd.grad: {share:.1f} µs above a torch mul's "
          f"autograd step (target 40)")
    print(f"{host_us(step, calls // 4):8.1f} µs  module step d128 rotate (fwd + bwd)")
    print(f"{in_thread(lambda: compressed_offsets(cu, ratio)):8.1f} µs  compressed_offsets "
          "from another thread")
    print(f"{in_thread(pool_backward_direct):8.1f} µs  pool_backward from another thread")
    print(f"{in_thread(lambda: cu.add(1)):8.1f} µs  torch add from another thread")
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("the pooling op's fwd + bwd", pool_step), ("the module step", step)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"\n{name}, 20 calls, by CPU time:")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
