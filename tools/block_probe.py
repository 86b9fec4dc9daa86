"""What-if probe for the next forward design (not a product kernel; nothing dispatches to
it): a CTA's ``rows`` consecutive rows staged as ONE contiguous token block.

With coff 2 the windows of consecutive rows tile the tokens: rows r0 .. r0+R-1 read the
token rows [r0*ratio - ratio, (r0+R)*ratio), every column of each (the previous block's
first d columns, the own block's last d). So a CTA can stage its rows' windows with one
bulk copy (cp.async.bulk) a token row and tensor, all issued at its start behind one
mbarrier: ~(R+1)*ratio*coff*d*2 bytes a tensor in flight from a few instructions, one
segment search a row lane and one APE load a CTA, instead of every thread's cp.async
stages refilled row after row (pool_fwd.py). The rows then read their windows from shared
memory and pool them with the product kernel's own helpers (softmax.softmax_row, mul_rn), so
the outputs are bitwise pool_forward's.

Only packs whose segments are whole blocks of ``ratio`` tokens (then row r's first token
is r*ratio, so a block's rows are contiguous in the tokens), coff 2, and no padding rows:
the host checks that. Shared-memory indices are clamped, so other packs give wrong rows,
never an out-of-bounds access. What it measured is summarised in docs/lab/ceilings.md.

    source .device/env.sh && python3 tools/block_probe.py 1x8192:128:4:2,3x8192:512:4:2 [R=16,THREADS=128 ...]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import sys

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from csa_compressor.cli import bench
from csa_compressor import testing
from csa_compressor.kernel_api import pool_forward
from csa_compressor.kernels.ptx import mul_rn
from csa_compressor.kernels.segments import start_walk, walk_rows, walk_window
from csa_compressor.kernels.softmax import softmax_row
from csa_compressor.kernels.jit import direct as _direct
from csa_compressor.kernels.plan import _fake
from csa_compressor.kernels.plan import cutlass_dtype as _cutlass_dtype


class BlockForward:
    def __init__(self, dtype, ratio: int, head_dim: int, rows: int, threads: int,
                 vec_bytes: int = 8):
        eb = dtype.width // 8
        self.dtype, self.ratio, self.d, self.W = dtype, ratio, head_dim, 2 * head_dim
        self.vec = max(1, vec_bytes // eb)
        assert head_dim % self.vec == 0
        self.cpr = head_dim // self.vec
        self.lanes = self.cpr
        self.row_lanes = max(1, threads // self.lanes)
        self.threads = self.lanes * self.row_lanes
        self.rows = rows
        self.ntok = (rows + 1) * ratio  # token rows a block stages
        self.slots = 2 * ratio
        assert (self.W * eb) % 16 == 0, "a token row must be a legal bulk copy"
        self.smem_bytes = 2 * self.ntok * self.W * eb + 64

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mSc: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, stream):
        tiler = (1, self.vec)
        num_rows = mOut.shape[0]
        grid_x = (num_rows + self.rows - 1) // self.rows
        self.kernel(mKV, mSc, cute.zipped_divide(mApe, tiler), mCu, mCuc,
                    cute.zipped_divide(mOut, tiler), num_rows, mKV.shape[0]).launch(
            grid=[grid_x, 1, 1], block=[self.lanes, self.row_lanes, 1], smem=self.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mKV: cute.Tensor, mSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32):
        cute.arch.griddepcontrol_wait()
        tid, ty, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        r, vec, CH, W = self.ratio, self.vec, self.slots, self.W
        eb = self.dtype.width // 8
        num_seqs = mCuc.shape[0] - 1
        thr = ty * self.lanes + tid
        smem = cutlass.memory.SmemAllocator()
        lay = cute.make_layout((self.ntok, W), stride=(W, 1))
        sS = smem.allocate_tensor(self.dtype, lay, 16)
        sV = smem.allocate_tensor(self.dtype, lay, 16)
        bars = smem.allocate_tensor(Int64, cute.make_layout((2,)), 16)
        bar = bars.iterator
        row0 = bx * self.rows
        base = row0 * r - r
        if base < 0:
            base = Int32(0)
        ntok = num_tokens - base
        if ntok > self.ntok:
            ntok = Int32(self.ntok)
        if ntok < 0:
            ntok = Int32(0)
        if thr == 0:
            cute.arch.mbarrier_init(bar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if thr == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, ntok * (2 * W * eb))
        cute.arch.barrier()
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.dtype,
                                   num_bits_per_copy=W * self.dtype.width)
        vl = cute.make_layout((W,))
        for k in cutlass.range(thr, ntok, self.threads):
            goff = cute.assume((base + k) * W, divby=16 // eb)
            soff = cute.assume(k * W, divby=16 // eb)
            for src, dst in ((mSc, sS), (mKV, sV)):
                g, s = cpasync.group_bulk_copy_modes(cute.make_tensor(src.iterator + goff, vl),
                                                     cute.make_tensor(dst.iterator + soff, vl))
                cute.copy(atom, g, s, mbar_ptr=bar)
        apef = cute.make_rmem_tensor((CH, vec), Float32)
        for k in cutlass.range_constexpr(CH):
            a32 = gApe[(None, (k % r, tid if k < r else self.cpr + tid))].load()
            for e in cutlass.range_constexpr(vec):
                apef[k, e] = a32[e]
        walk = start_walk(mCu, mCuc, row0 + ty, num_seqs)
        sSd = cute.zipped_divide(sS, (1, vec))
        sVd = cute.zipped_divide(sV, (1, vec))
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        acc = cute.make_rmem_tensor((vec,), Float32)
        res = cute.make_rmem_tensor((vec,), self.dtype)
        cute.arch.mbarrier_wait(bar, 0)
        for j in cutlass.range(ty, self.rows, self.row_lanes):
            row = row0 + j
            if row < num_rows:
                walk = walk_rows(mCu, mCuc, walk, row, num_seqs)
                t0, has_prev, ok = walk_window(walk, row, num_seqs, num_tokens, r, 2)
                for e in cutlass.range_constexpr(vec):
                    acc[e] = Float32(0.0)
                if ok:
                    self.read_window(sSd, sVd, apef, sf, vf, t0 - base, has_prev, tid)
                    softmax_row(sf, vec, CH)
                    for e in cutlass.range_constexpr(vec):
                        a = mul_rn(vf[0, e], sf[0, e])
                        for k in cutlass.range_constexpr(1, CH):
                            a = a + mul_rn(vf[k, e], sf[k, e])
                        acc[e] = a
                res.store(acc.load().to(self.dtype))
                gOut[(None, (row, tid))].store(res.load())

    @cute.jit
    def read_window(self, sSd, sVd, apef, sf, vf, li0, has_prev, tid):
        """Row's window from the staged block (``li0``: its first own token's index there),
        indices clamped into the block; empty previous slots -inf / 0 as the contract says."""
        r, vec = self.ratio, self.vec
        for k in cutlass.range_constexpr(self.slots):
            li = li0 + (k - r)
            if li < 0:
                li = Int32(0)
            if li > self.ntok - 1:
                li = Int32(self.ntok - 1)
            colc = tid if k < r else self.cpr + tid
            if cutlass.const_expr(k < r):
                if has_prev:
                    s = sSd[(None, (li, colc))].load().to(Float32)
                    v = sVd[(None, (li, colc))].load().to(Float32)
                    for e in cutlass.range_constexpr(vec):
                        sf[k, e] = s[e] + apef[k, e]
                        vf[k, e] = v[e]
                else:
                    for e in cutlass.range_constexpr(vec):
                        sf[k, e] = -Float32.inf
                        vf[k, e] = Float32(0.0)
            else:
                s = sSd[(None, (li, colc))].load().to(Float32)
                v = sVd[(None, (li, colc))].load().to(Float32)
                for e in cutlass.range_constexpr(vec):
                    sf[k, e] = s[e] + apef[k, e]
                    vf[k, e] = v[e]


def compile_block(dtype, ratio, head_dim, rows, threads, vec_bytes):
    kernel = BlockForward(_cutlass_dtype(dtype), ratio, head_dim, rows, threads, vec_bytes)
    cdt = _cutlass_dtype(dtype)
    W = 2 * head_dim
    T, N, B1 = (cute.sym_int32() for _ in range(3))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = cute.compile(kernel, _fake(cdt, (T, W), 16), _fake(cdt, (T, W), 16),
                      _fake(cutlass.Float32, (ratio, W), 16), _fake(cutlass.Int32, (B1,), 4),
                      _fake(cutlass.Int32, (B1,), 4), _fake(cdt, (N, head_dim), 16), stream,
                      options="--enable-tvm-ffi")
    kernel.compiled = fn
    return kernel, _direct(fn)


def main():
    """Each shape: pool_forward, then every variant ("R=<rows a CTA>,THREADS=<n>,VEC=<bytes>")
    of the block forward, timed as the bench times (graphs of 20 calls over rotating input
    sets) and compared bitwise with pool_forward. CSA_CONFIG (kernels/tuning.py) applies
    to pool_forward."""
    import os

    shapes = sys.argv[1].split(",")
    variants = sys.argv[2:] or ["R=16,THREADS=128"]
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    what = os.environ.get("CSA_CONFIG", "") or "default tuning"
    compiled = {}
    for name in shapes:
        shape = testing.parse_shape(name)
        assert shape.coff == 2 and all(n % shape.ratio == 0 for n in shape.lens), name
        set_bytes = 4 * sum(shape.lens) * shape.coff * shape.d
        n = bench.input_sets(set_bytes, l2)
        sets = [testing.make_inputs(shape, torch.bfloat16, dev, seed=i) for i in range(n)]
        N = sets[0][5]
        assert N == sum(shape.lens) // shape.ratio, "no padding rows"
        outs = [torch.empty(N, shape.d, dtype=torch.bfloat16, device=dev) for _ in sets]
        mine = [torch.empty_like(o) for o in outs]

        def prod(i):
            kv, score, ape, cu, cuc = sets[i][:5]
            pool_forward(kv, score, ape, cu, cuc, outs[i], ratio=shape.ratio, coff=2)

        print(f"{name} [{what}] pool_forward {bench.time_graph(prod, n):.2f} µs", flush=True)
        for v in variants:
            kw = dict(item.split("=") for item in v.split(","))
            R, thr, vb = int(kw.get("R", 16)), int(kw.get("THREADS", 128)), int(kw.get("VEC", 8))
            key = (shape.ratio, shape.d, R, thr, vb)
            if key not in compiled:
                compiled[key] = compile_block(torch.bfloat16, shape.ratio, shape.d, R, thr, vb)
            kernel, fn = compiled[key]

            def block(i):
                kv, score, ape, cu, cuc = sets[i][:5]
                fn(kv, score, ape, cu, cuc, mine[i])

            us = bench.time_graph(block, n)
            prod(0)
            block(0)
            torch.cuda.synchronize()
            diff = (outs[0].view(torch.int16) != mine[0].view(torch.int16)).sum().item()
            print(f"{name} [{what}] block {v} ({kernel.threads} threads, "
                  f"{kernel.smem_bytes // 1024} KB smem): {us:.2f} µs, "
                  f"{diff} of {outs[0].numel()} elements differ from pool_forward", flush=True)


if __name__ == "__main__":
    main()
