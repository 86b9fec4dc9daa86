"""The pooling kernels with the epilogue (RMSNorm, rotary embedding, Hadamard rotation)
inside them: one launch a direction instead of a pooling and a row kernel.

- forward: the tuned pooling writes the CTA's pooled rows (they are the node's saved
  input), then, after one CTA barrier, its warps take those rows one a warp and run
  epilogue_rows.EpilogueRows.forward_row on them, reading back what the CTA just wrote
  (from L2), and write the output and the norm's statistics;
- backward: first the warps run EpilogueRows.backward_row on the CTA's rows, the
  output's gradient through the rotation, the rotary embedding and the norm into the
  pooled rows' gradient (written where the pooling then reads it, and the weight's
  products for its column sum), then, after one CTA barrier, the pooling backward as
  ever. Where the pooling splits a row over column groups (d=512 bf16's backward), each
  group computes the whole row and writes its own columns.

The row math is EpilogueRows's, op for op, so the output and every gradient are bitwise
those of the pooling followed by the epilogue node (epilogue_op.apply_epilogue). The norm's
mean counts the rows of the whole pack (torch's ``mean`` of the ``(N, d)`` rows).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .epilogue_rows import EpilogueRows
from .pool_bwd import PoolBackward
from .pool_fwd import PoolForward
from .pool_long import LongPoolBackward, LongPoolForward
from .staging import smem_footprint


class EpilogueWarps:
    """What both directions share: the warps of the CTA taking rows, the rows' scratch in
    shared memory (one row a warp, the norm's row sums), the flat row of an SBHD
    sequence's row. Needs ``threads``, ``lanes``, ``d``, ``batch`` and ``smem_bytes``."""

    def setup_epilogue(self, dtype, epilogue, backward: bool, scratch_warps: int = 0):
        """``scratch_warps``: the warps that take rows (0: all of them)."""
        self.epilogue_rows(dtype, epilogue, backward, scratch_warps)
        self.target_ctas_per_sm = max(1, min(self.target_ctas_per_sm, self.ctas_fitting_smem()))
        bound = self.target_ctas_per_sm  # unbounded, the d=512 forward fell from 4 to 3
        if backward and self.carveout is None:
            bound = 0  # as the plain kernel: d=128 held to its 3 spilled 8 B
        elif not backward and self.carveout is not None:
            bound -= 2  # narrow forwards: held to 8 at d=128 spilled 64 B, to 7 32 B, to 6 none
        self.hold_to(bound)

    def epilogue_rows(self, dtype, epilogue, backward: bool, scratch_warps: int = 0,
                      alias: bool = True):
        """The row math and its shared scratch (one row a warp that takes rows). ``alias``:
        the rows run while the pooling's shared memory is idle (before its first copy, or
        after its last read and a CTA barrier), so the scratch lies over it where it fits."""
        assert self.threads % 32 == 0, "the epilogue takes whole warps"
        self.rows_ep = EpilogueRows(dtype, self.d, epilogue.rope_dim, epilogue.interleaved,
                                    epilogue.rotate, backward, norm=True, eps=epilogue.eps)
        self.E, self.cs_vec = self.rows_ep.E, self.rows_ep.cs_vec  # a lane's channels, cos/sin
        self.warps = self.threads // 32
        self.scratch_warps = scratch_warps or self.warps
        need = smem_footprint(self.scratch_warps * self.d * 4)
        # Over the pooling's buffers the kernel asks for the pooling's shared memory alone,
        # so its carveout leaves the L1 the plain kernel has (d=512's backward: 70% instead
        # of 91%); otherwise the scratch is an allocation of its own, which the DSL adds.
        self.scratch_aliased = alias and need <= self.smem_bytes
        if not self.scratch_aliased:
            self.smem_bytes = self.smem_bytes + need

    def epilogue_tiles(self, mX, mW, mCos, mSin, mOut, mAux=None):
        E, cs = self.E, self.cs_vec
        tiles = (cute.zipped_divide(mX, (1, E)), cute.zipped_divide(mW, (E,)),
                 cute.zipped_divide(mCos, (1, cs)), cute.zipped_divide(mSin, (1, cs)),
                 cute.zipped_divide(mOut, (1, E)))
        if mAux is not None:
            tiles = tiles + (cute.zipped_divide(mAux, (1, E)),)
        return tiles

    @cute.jit
    def scratch(self):
        layout = cute.make_layout((self.scratch_warps, self.d), stride=(self.d, 1))
        if cutlass.const_expr(self.scratch_aliased):
            return cute.make_tensor(cute.arch.get_dyn_smem(Float32, 16), layout)
        return cutlass.memory.SmemAllocator().allocate_tensor(Float32, layout, 16)

    @cute.jit
    def warp_lane(self):
        tid, ty, _ = cute.arch.thread_idx()
        thr = ty * self.lanes + tid
        return thr // 32, thr % 32

    @cute.jit
    def flat_row(self, row):
        """The row's index in the ``(N * batch, d)`` rows of an SBHD launch (sequence
        ``z``'s row ``row`` is flat row ``row * batch + z``); ``row`` in a THD launch."""
        if cutlass.const_expr(self.batch):
            _, _, bz = cute.arch.block_idx()
            return row * self.batch + bz
        else:
            return row


class EpilogueBackward(EpilogueWarps):
    """The launch and the kernel of both backwards (PoolEpilogueBackward,
    LongPoolEpilogueBackward): the epilogue's backward of the row CTA's rows, then the
    pooling backward (``pool_after``); they differ in that pooling and in the columns a CTA
    owns (``owns``)."""

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mGrad: cute.Tensor, mDKV: cute.Tensor, mDScore: cute.Tensor,
                 mWork: cute.Tensor, rows_per_cta: Int32, num_row_ctas: Int32,
                 num_zero_ctas: Int32, mGY: cute.Tensor, mX: cute.Tensor, mR: cute.Tensor,
                 mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor, mGX: cute.Tensor,
                 mAux: cute.Tensor, stream):
        """BackwardGrid's launch, plus: ``mGY`` the output's gradient (flat rows), ``mX``
        the pooled rows, ``mR`` their statistics, the norm weight, cosines and sines,
        ``mGX`` the pooled rows' gradient as flat rows (written here; ``mGrad`` is the
        pooling's view of it), ``mAux`` the weight's products (fp32, written)."""
        tiler = (1, self.vec)
        gY, gW, gCos, gSin, gX, gAux = self.epilogue_tiles(mGY, mW, mCos, mSin, mX, mAux)
        self.kernel(
            cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
            cute.zipped_divide(mApe, tiler), mCu, mCuc, cute.zipped_divide(mGrad, tiler),
            cute.zipped_divide(mDKV, tiler), cute.zipped_divide(mDScore, tiler),
            cute.zipped_divide(mWork, tiler), mGrad.shape[0], mKV.shape[0], rows_per_cta,
            num_row_ctas, gY, gX, mR, gW, gCos, gSin, cute.zipped_divide(mGX, (1, self.E)),
            gAux,
        ).launch(grid=self.grid(num_row_ctas + num_zero_ctas),
                 block=[self.lanes, self.row_lanes, 1], smem=self.smem_bytes, stream=stream,
                 use_pdl=True, preferred_smem_carveout=self.carveout,
                 min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gGrad: cute.Tensor, gDKV: cute.Tensor, gDSc: cute.Tensor,
               gWork: cute.Tensor, num_rows: Int32, num_tokens: Int32, rows_per_cta: Int32,
               num_row_ctas: Int32, gY: cute.Tensor, gX: cute.Tensor, mR: cute.Tensor,
               gW: cute.Tensor, gCos: cute.Tensor, gSin: cute.Tensor, gGX: cute.Tensor,
               gAux: cute.Tensor):
        sRow = self.scratch()
        tid, ty, _ = cute.arch.thread_idx()
        bx, by = self.cta_coords()
        # The plain backwards' reasons (PoolBackward.kernel, LongPoolBackward.kernel).
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        if bx < num_row_ctas:  # uniform over the CTA
            self.rows_backward(gY, gX, mR, gW, gCos, gSin, gGX, gAux, sRow, num_rows,
                               rows_per_cta, bx, by)
        self.pool_after(gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows,
                        num_tokens, rows_per_cta, num_row_ctas, tid, ty, bx, by)

    @cute.jit
    def rows_backward(self, gY, gX, mR, gW, gCos, gSin, gGX, gAux, sRow, num_rows, rows_per_cta,
                      bx, by):
        """The epilogue's backward of row CTA ``bx``'s rows, a warp a row, into the rows'
        gradient; the CTA stores the columns it owns (of the weight's products too), then
        meets its threads at a barrier: the gradient is in global memory, visible to them."""
        warp, lane = self.warp_lane()
        mine = self.owns(lane, by)
        for j in cutlass.range(warp, rows_per_cta, self.warps):
            row = bx * rows_per_cta + j
            if row < num_rows:  # uniform over the warp
                flat = self.flat_row(row)
                v = self.rows_ep.load_row(gY, flat, lane)
                self.rows_ep.backward_row(v, gX, mR, gW, gCos, gSin, gAux, sRow, flat, warp,
                                          lane, mine)
                if mine:
                    gGX[(None, (flat, lane))].store(v.load().to(self.dtype))
                cute.arch.sync_warp()
        cute.arch.barrier()


class PoolEpilogueForward(EpilogueWarps, PoolForward):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9,
                 tuning=None, row_stride: int = 0, batch: int = 0, numerics: str = "fp32",
                 epilogue=None):
        super().__init__(dtype, ratio, coff, head_dim, arch_major, tuning, row_stride, batch,
                         numerics)
        assert self.col_groups == 1, "a CTA holds whole rows"
        self.setup_epilogue(dtype, epilogue, backward=False)

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, rows_per_thread: Int32, mX: cute.Tensor,
                 mR: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                 mY: cute.Tensor, stream):
        """PoolForward's launch, plus: ``mX`` the pooled rows ``mOut`` as ``(N*batch, d)``
        flat rows (the same memory), ``mR`` their statistics (written), the norm weight,
        the rows' cosines and sines, and ``mY`` the output (flat rows)."""
        tiler = (1, self.vec)
        num_rows = mOut.shape[0]
        rows_per_cta = rows_per_thread * self.row_lanes
        grid_x = (num_rows + rows_per_cta - 1) // rows_per_cta
        gX, gW, gCos, gSin, gY = self.epilogue_tiles(mX, mW, mCos, mSin, mY)
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mApe, tiler), mCu, mCuc, cute.zipped_divide(mOut, tiler),
                    num_rows, mKV.shape[0], rows_per_thread, gX, mR, gW, gCos, gSin, gY).launch(
            grid=[grid_x, 1, self.grid_z()], block=[self.lanes, self.row_lanes, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=True,
            preferred_smem_carveout=self.carveout, min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, num_rows: Int32, num_tokens: Int32,
               rows_per_thread: Int32, gX: cute.Tensor, mR: cute.Tensor, gW: cute.Tensor,
               gCos: cute.Tensor, gSin: cute.Tensor, gY: cute.Tensor):
        sRow = self.scratch()
        cute.arch.griddepcontrol_wait()  # PoolForward.kernel's reason
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gOut, num_rows, num_tokens, rows_per_thread)
        # The CTA's pooled rows are in global memory and visible to all its threads.
        cute.arch.barrier()
        bx, _, _ = cute.arch.block_idx()
        warp, lane = self.warp_lane()
        count = rows_per_thread * self.row_lanes
        first = bx * count
        total = mR.shape[0]
        for j in cutlass.range(warp, count, self.warps):
            row = first + j
            if row < num_rows:  # uniform over the warp
                flat = self.flat_row(row)
                v = self.rows_ep.load_row(gX, flat, lane)
                self.rows_ep.forward_row(v, sRow, mR, gW, gCos, gSin, flat, total, warp, lane)
                gY[(None, (flat, lane))].store(v.load().to(self.dtype))
                # the next row's statistics reuse the warp's scratch
                cute.arch.sync_warp()


class PoolEpilogueBackward(EpilogueBackward, PoolBackward):
    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, arch_major: int = 9,
                 large: bool = False, tuning=None, row_stride: int = 0, batch: int = 0,
                 numerics: str = "fp32", epilogue=None):
        super().__init__(dtype, ratio, coff, head_dim, arch_major, large, tuning, row_stride,
                         batch, numerics)
        assert 32 % self.col_groups == 0
        self.group_lanes = 32 // self.col_groups  # lanes of a row whose columns a group owns
        self.setup_epilogue(dtype, epilogue, backward=True)

    @cute.jit
    def owns(self, lane, by):
        """Whether lane ``lane``'s channels are column group ``by``'s."""
        return lane // self.group_lanes == by

    @cute.jit
    def pool_after(self, gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows,
                   num_tokens, rows_per_cta, num_row_ctas, tid, ty, bx, by):
        """PoolBackward's CTA work after the epilogue's rows."""
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows, num_tokens,
                       rows_per_cta, num_row_ctas, tid, ty, bx, by)


class LongPoolEpilogueForward(EpilogueWarps, LongPoolForward):
    """The slot-parallel forward with the epilogue: a row's columns are the pooled values
    of ``col_groups`` CTAs, so the CTA that finishes a row last (a per-row count, bumped
    once a CTA after its columns are stored) runs the row's epilogue with one warp, reading
    the row back as the register-resident forward does."""

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, tuning=None,
                 row_stride: int = 0, batch: int = 0, numerics: str = "fp32", epilogue=None):
        super().__init__(dtype, ratio, coff, head_dim, tuning, row_stride, batch, numerics)
        # Its scratch stays an allocation beside the flag: this forward is off by default
        # (EpilogueInside.long), and laying its scratch over the pooling's buffers is untried.
        self.epilogue_rows(dtype, epilogue, backward=False, scratch_warps=1, alias=False)
        self.smem_bytes += 16  # the CTA's "last of its row" flag
        self.hold_to(self.held)  # the pooling's bound, the carveout for the scratch

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mScore: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor,
                 mCuc: cute.Tensor, mOut: cute.Tensor, rows_per_thread: Int32, mX: cute.Tensor,
                 mR: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                 mY: cute.Tensor, mCount: cute.Tensor, stream):
        """LongPoolForward's launch, plus PoolEpilogueForward's arguments and ``mCount``
        the rows' counts (int32, one a flat row, zero before the launch)."""
        tiler = (1, self.vec)
        gX, gW, gCos, gSin, gY = self.epilogue_tiles(mX, mW, mCos, mSin, mY)
        self.kernel(cute.zipped_divide(mKV, tiler), cute.zipped_divide(mScore, tiler),
                    cute.zipped_divide(mApe, tiler), mCu, mCuc, mOut, mKV.shape[0], gX, mR, gW,
                    gCos, gSin, gY, mCount).launch(
            grid=[mOut.shape[0], self.col_groups, self.grid_z()], block=[self.lanes, self.groups, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=True,
            preferred_smem_carveout=self.carveout, min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32, gX: cute.Tensor,
               mR: cute.Tensor, gW: cute.Tensor, gCos: cute.Tensor, gSin: cute.Tensor,
               gY: cute.Tensor, mCount: cute.Tensor):
        sRow = self.scratch()
        last = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout((1,)), 16)
        cute.arch.griddepcontrol_wait()  # LongPoolForward.kernel's reason
        self.pool_row(gKV, gSc, gApe, mCu, mCuc, mOut, num_tokens)
        row, _, _ = cute.arch.block_idx()
        flat = self.flat_row(row)
        warp, lane = self.warp_lane()
        # The CTA's columns are stored before its count: the count's last bump sees them all.
        cute.arch.barrier()
        if (warp == 0) & (lane == 0):
            cute.arch.fence_acq_rel_gpu()
            done = cute.arch.atomic_add((mCount.iterator + flat).llvm_ptr, Int32(1),
                                        sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
            last[0] = Int32(done == self.col_groups - 1)
        cute.arch.barrier()
        if (last[0] != 0) & (warp == 0):
            v = self.rows_ep.load_row(gX, flat, lane)
            self.rows_ep.forward_row(v, sRow, mR, gW, gCos, gSin, flat, mR.shape[0], 0, lane)
            gY[(None, (flat, lane))].store(v.load().to(self.dtype))


class LongPoolEpilogueBackward(EpilogueBackward, LongPoolBackward):
    """The slot-parallel backward with the epilogue's backward first: every column group's
    row CTA computes its rows' epilogue backward whole (a row is one warp's; the norm needs
    the whole row) and stores its own columns of the rows' gradient and of the weight's
    products, then, after one CTA barrier, runs the pooling backward on them."""

    def __init__(self, dtype, ratio: int, coff: int, head_dim: int, tuning=None,
                 row_stride: int = 0, batch: int = 0, numerics: str = "fp32", epilogue=None):
        super().__init__(dtype, ratio, coff, head_dim, tuning, row_stride, batch, numerics)
        self.epilogue_rows(dtype, epilogue, backward=True)
        assert self.cols % self.E == 0, "a lane's channels lie in one column group"
        self.target_ctas_per_sm = min(self.held, self.ctas_fitting_smem())
        self.hold_to(self.target_ctas_per_sm)

    @cute.jit
    def owns(self, lane, by):
        """Whether lane ``lane``'s channels are column group ``by``'s."""
        return (lane * self.E) // self.cols == by

    @cute.jit
    def pool_after(self, gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows,
                   num_tokens, rows_per_cta, num_row_ctas, tid, ty, bx, by):
        """LongPoolBackward's CTA work after the epilogue's rows (its own thread indices)."""
        self.pool_rows(gKV, gSc, gApe, mCu, mCuc, gGrad, gDKV, gDSc, gWork, num_rows, num_tokens,
                       rows_per_cta, num_row_ctas)
