"""Developer probe (H200): what a launch costs under the bench's method before any bytes
matter, to split our kernels' fixed cost into launch, dependent memory rounds and the rest.

    python tools/latency_probe.py

Each row is µs per call of a CUDA graph of 20 calls (bench.time_graph), data L2-resident:
- chain<k>: a CuTe kernel of one 128-thread CTA whose threads make k dependent loads
  (i = a[i], a[i] = i) and store the result: launch + k L2 round trips;
- dependent<n>: chain0 with n dependent fp32 multiplies (inline PTX, one instruction each,
  so nothing folds them): n times the multiply's latency (4 cycles), the calibration;
- straight<n>: the same n multiplies as 8 independent chains, issue-bound (~n cycles at
  one instruction a cycle a warp): what fetching and issuing n instructions of
  straight-line code costs a launch. Our forward is ~1,900 SASS instructions and the
  backward ~1,400 (tools/sass_probe.py); time well above n cycles means instruction fetch;
- chain0 + chain0 asking S KB: two launches a call, the second asking for S KB of shared
  memory (a different L1/shared split from the first when S > 0);
- ours fwd / fwd+bwd at 1x4:128:4:2 (one row, the kernel-level API, preallocated
  buffers): our kernels with nothing to do.
The difference between ours and chain<3> (our forward's dependent rounds: segment search,
segment bounds, window) is what is neither launch nor memory latency.
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from csa_compressor.cli import bench
from csa_compressor import testing
from csa_compressor.kernel_api import pool_backward, pool_forward
from csa_compressor.kernels import compile as cc
from csa_compressor.kernels import plan
from csa_compressor.kernels.ptx import mul_rn


class Chain:
    def __init__(self, rounds: int, smem_bytes: int = 0, straight: int = 0, chains: int = 1):
        self.rounds = rounds
        self.smem_bytes = smem_bytes  # dynamic shared memory asked for, never touched
        self.straight = straight
        self.chains = chains

    @cute.jit
    def __call__(self, mA: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mA, mOut).launch(grid=[1, 1, 1], block=[128, 1, 1], smem=self.smem_bytes,
                                     stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mOut: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        i = Int32(tid)
        for _ in cutlass.range_constexpr(self.rounds):
            i = mA[i]
        if cutlass.const_expr(self.straight > 0):
            xs = [cutlass.Float32(i + c) for c in range(self.chains)]
            for k in cutlass.range_constexpr(self.straight):
                c = k % self.chains
                xs[c] = mul_rn(xs[c], cutlass.Float32(1.0000001))
            for c in cutlass.range_constexpr(self.chains):
                i = i + Int32(xs[c] > cutlass.Float32(1e30))
        mOut[tid] = i


def compile_chain(rounds: int, smem_bytes: int = 0, straight: int = 0, chains: int = 1):
    n = cute.sym_int32()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = cute.compile(Chain(rounds, smem_bytes, straight, chains), plan._fake(cutlass.Int32, (n,), 4), plan._fake(cutlass.Int32, (n,), 4),
                      stream, options="--enable-tvm-ffi")
    return cc._direct(fn), fn


def main():
    dev = torch.device("cuda")
    a = torch.arange(128, dtype=torch.int32, device=dev)
    out = torch.empty_like(a)
    for k in range(4):
        run, keep = compile_chain(k)
        print(f"chain{k} (launch + {k} dependent L2 loads) {bench.time_graph(lambda _: run(a, out), 1):7.2f} µs")
    for n in (1000, 2000):
        run, keep = compile_chain(0, 0, n)
        print(f"dependent{n} (launch + {n} dependent multiplies)  {bench.time_graph(lambda _: run(a, out), 1):7.2f} µs")
    for n in (1000, 2000, 4000, 8000):
        run, keep = compile_chain(0, 0, n, 8)
        print(f"straight{n} (launch + {n} multiplies, 8 chains)  {bench.time_graph(lambda _: run(a, out), 1):7.2f} µs")
    # Two kernels a call, alike or asking for different shared memory (the forward stages
    # 16 KB a CTA at d=128, the backward 68 KB): does an L1/shared split change between
    # consecutive kernels cost time?
    plain, keep0 = compile_chain(0)
    for smem in (0, 16 * 1024, 68 * 1024):
        big, keep1 = compile_chain(0, smem)

        def pair(_):
            plain(a, out)
            big(a, out)
        print(f"chain0 + chain0 asking {smem // 1024:3d} KB shared      {bench.time_graph(pair, 1):7.2f} µs")
    kv, score, ape, cu, cuc, N, g = testing.make_inputs(testing.parse_shape("1x4:128:4:2"), torch.bfloat16, dev)
    o = torch.empty(N, 128, dtype=torch.bfloat16, device=dev)
    dkv, dsc, dape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)

    def fwd(_):
        pool_forward(kv, score, ape, cu, cuc, o, ratio=4, coff=2)

    def fwdbwd(_):
        fwd(_)
        pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=4, coff=2)

    print(f"ours fwd, 1x4:128:4:2, kernel-level     {bench.time_graph(fwd, 1):7.2f} µs")
    print(f"ours fwd+bwd, 1x4:128:4:2, kernel-level {bench.time_graph(fwdbwd, 1):7.2f} µs")


if __name__ == "__main__":
    main()
