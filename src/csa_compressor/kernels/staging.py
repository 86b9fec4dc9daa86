"""Window slots: their geometry, loads into registers and cp.async staging through shared
memory, shared by the pooling kernels."""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync

from . import hardware
from .ptx import widen_bf16
from .segments import find_segment, find_segment_warp, in_bounds


def smem_footprint(*sizes: int) -> int:
    """Bytes that consecutive shared-memory allocations of ``sizes`` bytes take when each
    starts 16-byte aligned (SmemAllocator.allocate_tensor(..., 16)), as launches must ask
    for. Summing the bare sizes under-asked where a buffer's size is not a multiple of 16:
    the fp32 head_dim-65 backward's grad_out stages (195 threads, 2,340 bytes) pushed its
    last buffer 12 bytes past the 46,020 asked for (tests/compile_probe.py models it);
    compute-sanitizer caught the same overrun in a candidate with a 780-byte buffer."""
    return sum(-(-n // 16) * 16 for n in sizes)


class Tiles:
    """What one thread reads a window from: the global tiles of ``kv``, ``score`` and
    ``ape`` (``(vec) x (rows, chunks)`` zipped divides), its column ``chunk``, and where the
    kernel stages, its index ``thr`` in the CTA, the shared ``sS`` / ``sV`` stages with
    their copy ``atom``, and ``apef``, the APE in registers (None: read with each slot). A
    backward adds its grad_out tile, stages and atom. Plain trace-time Python: the code is
    what passing each apart generated."""

    __slots__ = ("kv", "score", "ape", "chunk", "thr", "sS", "sV", "atom", "apef", "grad", "sG",
                 "grad_atom")

    def __init__(self, kv, score, ape, chunk, thr=None, sS=None, sV=None, atom=None, apef=None,
                 grad=None, sG=None, grad_atom=None):
        self.kv, self.score, self.ape, self.chunk, self.thr = kv, score, ape, chunk, thr
        self.sS, self.sV, self.atom, self.apef = sS, sV, atom, apef
        self.grad, self.sG, self.grad_atom = grad, sG, grad_atom


class WindowSlots:
    """Slot geometry, loading and cp.async staging shared by the kernels: needs ``dtype``,
    ``ratio``, ``coff``, ``cpr`` (column chunks per row), ``vec``, ``chunk_slots`` (slots
    loaded per call), and for staging ``slots`` and ``threads``.

    Staging buffers are (vec, thread, slot, stage), so a warp's vectors of one slot are
    consecutive in shared memory (no bank conflicts) as they are in global memory. Each
    thread reads back only its own vectors. Where every warp holds one row
    (coop_stageable) the warp copies them together in 16-byte pieces
    (stage_window_warp) and syncs after ``cp.async.wait_group`` and before reusing a
    stage; otherwise each thread copies its own and ``cp.async.wait_group`` is all the
    synchronisation needed."""

    # False: a pack with no position bias. ``ape`` is then the offsets guard's flag
    # buffer (0, or NaN for malformed offsets) and a backward sums no dape partials.
    has_ape = True

    coop = False  # warp-cooperative staging (coop_stageable), set by the kernels that use it
    row_stride = None  # elements between token rows of kv / score (and dkv / dscore): set_rows
    batch = 0  # SBHD sequences, one a grid.z index (0: a THD pack, no batch index): set_rows

    def set_rows(self, row_stride: int, batch: int = 0):
        """Token rows ``row_stride`` elements apart (0: packed, ``coff * head_dim``); a
        constant of the compiled code, so the slots stay immediate offsets of one base.
        ``batch``: an SBHD launch of ``batch`` sequences interleaved token by token, one a
        grid.z index: sequence ``z`` starts ``z * row_stride // batch`` elements into the
        token tensors and ``z * head_dim`` into the row tensors (output, grad_out), whose
        rows are ``batch * head_dim`` apart; every other index is the one-sequence pack's."""
        self.row_stride = row_stride or self.coff * self.d
        self.batch = batch

    def grid_z(self) -> int:
        return self.batch or 1

    def batch_shift(self, g: cute.Tensor, per_sequence) -> cute.Tensor:
        """``g`` moved to this CTA's SBHD sequence (``per_sequence`` elements a grid.z step);
        ``g`` itself in a THD launch. The step is a multiple of 16 bytes (validate_sbhd), so
        the vector accesses keep their alignment. Trace-time Python, called in a kernel."""
        if self.batch:
            _, _, bz = cute.arch.block_idx()
            step = 16 * 8 // g.element_type.width
            off = cute.assume(bz * per_sequence, divby=step)
            g = cute.make_tensor(g.iterator + off, g.layout)
        return g

    def batch_tensors(self, tokens, rows, work=None, work_rows=None):
        """batch_shift of a launch's token tensors (kv, score, dkv, dscore), row tensors
        (output or grad_out) and dape partials (``work_rows`` partial rows a sequence)."""
        tokens = [self.batch_shift(t, self.row_stride // max(self.batch, 1)) for t in tokens]
        rows = [self.batch_shift(t, self.d) for t in rows]
        if work is not None:
            work = self.batch_shift(work, work_rows * self.coff * self.d)
        return tokens, rows, work

    def specialise(self):
        """Code choices that follow from the geometry, made once at construction (after
        dtype, vec, cpr and lanes are set)."""
        # A search whose key depends only on the row lane (or the CTA) runs as a 32-ary warp
        # search where every warp is 32 active column lanes of one row lane (fewer dependent
        # loads a search).
        self.warp_search = self.lanes % 32 == 0 and self.cpr % self.lanes == 0
        # bf16 -> fp32 as a shift or a mask of the 32-bit word: one instruction an element
        # instead of three a pair.
        self.bf16_bits = self.dtype is cutlass.BFloat16 and self.vec % 2 == 0

    @cute.jit
    def search(self, cu: cute.Tensor, x: Int32, num_seqs: Int32) -> Int32:
        """find_segment, as a warp where specialise() allowed it."""
        if cutlass.const_expr(self.warp_search):
            return find_segment_warp(cu, x, num_seqs)
        else:
            return find_segment(cu, x, num_seqs)

    @cute.jit
    def backward_registers(self):
        """A backward thread's registers: window scores and values, its grad_out vector, and
        its dape partial sums (zeroed)."""
        CH, vec = self.chunk_slots, self.vec
        sf = cute.make_rmem_tensor((CH, vec), Float32)
        vf = cute.make_rmem_tensor((CH, vec), Float32)
        gv = cute.make_rmem_tensor((vec,), Float32)
        dacc = cute.make_rmem_tensor((CH, vec), Float32)
        for kk in cutlass.range_constexpr(CH):
            for e in cutlass.range_constexpr(vec):
                dacc[kk, e] = Float32(0.0)
        return sf, vf, gv, dacc

    def hold_to(self, ctas: int):
        """Compile for ``ctas`` resident CTAs an SM (a register bound, min_blocks_per_mp)
        and size the grid for them; 0: no bound, the grid as it is and the carveout left
        to the driver. With a bound, the carveout that holds the bound's shared memory
        (the DSL needs one to compile a bound without a GPU)."""
        # SBHD kernels keep their sequence's moved base pointers in registers (a THD kernel's
        # stay in the parameter bank): under the THD bounds several spilled, so they go
        # unbounded and their grid follows the registers they take.
        self.held = ctas
        self.min_ctas = 0 if self.batch else ctas
        self.carveout = None
        if ctas:
            self.target_ctas_per_sm = ctas
            self.carveout = hardware.carveout_for(ctas, self.smem_bytes)

    def grid_ctas_per_sm(self, regs):
        """CTAs an SM the one-wave grid is sized for, given ``regs`` registers a thread
        (ptxas', from the cubin; None where unknown): the design's ``target_ctas_per_sm``
        (shared memory, tuning), or fewer where the registers hold fewer (a grid sized
        past them ran 1.2-2 waves)."""
        target = getattr(self, "target_ctas_per_sm", None)
        if target is None or not regs:
            return target
        return max(1, min(target, hardware.ctas_fitting_registers(regs, self.threads)))

    def ctas_fitting_smem(self) -> int:
        """CTAs of this kernel whose shared memory (``smem_bytes``) one SM holds."""
        return hardware.ctas_fitting_smem(self.smem_bytes)

    def stageable(self) -> bool:
        return self.vec * self.dtype.width // 8 in (4, 8, 16)  # the cp.async sizes

    def staging_bytes(self, stages: int) -> int:
        """Shared memory of alloc_staging(smem, stages): the score and kv stages."""
        half = stages * self.slots * self.threads * self.vec * self.dtype.width // 8
        return smem_footprint(half, half)

    def alloc_staging(self, smem, stages: int):
        layout = cute.make_layout((self.vec, self.threads, self.slots, stages))
        return (smem.allocate_tensor(self.dtype, layout, 16),
                smem.allocate_tensor(self.dtype, layout, 16))

    def copy_atom(self):
        return cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype,
                                   num_bits_per_copy=self.vec * self.dtype.width)

    @cute.jit
    def copy_vec(self, atom, src, dst):
        """One ``vec``-element cp.async from pointer ``src`` to pointer ``dst``, both sides
        as a single atom-sized vector."""
        vl = cute.make_layout(((self.vec,), 1))
        cute.copy(atom, cute.make_tensor(src, vl), cute.make_tensor(dst, vl))

    def slot_offset(self, k: int) -> int:
        """Elements from window slot 0's vector to slot k's, same column chunk: a constant."""
        own = self.coff == 2 and k >= self.ratio
        return k * self.row_stride + (self.d if own else 0)

    @cute.jit
    def window_base(self, g: cute.Tensor, t0, chunk):
        """Pointer to slot 0's vector of column chunk ``chunk`` (token t0 - ratio with
        coff 2, t0 otherwise; it may lie before the tensor when that slot is empty, and is
        then never read). One multiply-add and one 64-bit add a row: every slot is a
        constant offset from it, which the copies take as an immediate (indexing each slot
        cost a 64-bit address computation per copy, ~3 instructions)."""
        first = t0
        if cutlass.const_expr(self.coff == 2):
            first = t0 - self.ratio
        # Every term is a multiple of vec: say so, or the copies lose their alignment.
        off = cute.assume(first * self.row_stride + chunk * self.vec, divby=self.vec)
        return g.iterator + off

    def window_atom(self):
        """The copy atom of stage_window: 16-byte pieces where the warp stages together."""
        return self.coop_atom() if self.coop else self.copy_atom()

    @cute.jit
    def stage_window(self, tt: Tiles, t0, has_prev, stage):
        """Start the cp.async copies of a window's non-empty slots into ``stage``, with
        ``tt.atom`` = window_atom(): the warp's together where ``coop`` (stage_window_warp),
        else each thread's own vectors."""
        if cutlass.const_expr(self.coop):
            self.stage_window_warp(tt, t0, has_prev, stage)
        else:
            self.stage_window_own(tt, t0, has_prev, stage)

    @cute.jit
    def stage_window_own(self, tt: Tiles, t0, has_prev, stage):
        """stage_window, one ``vec`` copy a thread and slot."""
        bS = self.window_base(tt.score, t0, tt.chunk)
        bV = self.window_base(tt.kv, t0, tt.chunk)
        for k in cutlass.range_constexpr(self.slots):
            _, _, _, valid = self.slot_coords(Int32(k), t0, has_prev, tt.chunk)
            if valid:
                dS = tt.sS[(None, tt.thr, k, stage)].iterator
                dV = tt.sV[(None, tt.thr, k, stage)].iterator
                self.copy_vec(tt.atom, bS + self.slot_offset(k), dS)
                self.copy_vec(tt.atom, bV + self.slot_offset(k), dV)

    def coop_stageable(self) -> bool:
        """The window can be staged by warp-cooperative 16-byte copies (stage_window_warp):
        every warp is 32 column lanes of one row lane (so of one row), and every slot's
        32 vectors start 16-byte aligned (token rows and the own-half offset are multiples
        of 16 bytes; a warp's first chunk is a multiple of 32 vectors)."""
        eb = self.dtype.width // 8
        wb = 32 * self.vec * eb
        return (self.staged and self.lanes % 32 == 0 and self.cpr % self.lanes == 0
                and (self.row_stride * eb) % 16 == 0 and (self.d * eb) % 16 == 0
                and wb % 16 == 0 and 32 % (wb // 16) == 0)

    def coop_atom(self):
        return cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)

    @cute.jit
    def stage_window_warp(self, tt: Tiles, t0, has_prev, stage):
        """stage_window with the warp's copies shared out: a slot's 32 vectors are one
        contiguous run in global memory and in the staging buffer, so the lanes copy it
        in 16-byte pieces, several slots an instruction (4 for 4-byte vectors: 8 copies a
        row instead of 32). A lane then reads what other lanes copied: the caller
        synchronises the warp after cp.async.wait_group, and before issuing into a stage
        the warp read the step before.

        Lane ``l`` copies piece ``l % lpt`` of slot ``l // lpt + j * spi`` (lpt lanes a
        slot run, spi slots an instruction), for the slots that are not empty."""
        eb = self.dtype.width // 8
        n16 = 16 // eb  # elements in a 16-byte piece
        vl = cute.make_layout(((n16,), 1))
        thr, chunk = tt.thr, tt.chunk
        lpt = (32 * self.vec * eb) // 16  # lanes per slot run
        spi = 32 // lpt  # slots an instruction
        lane = cute.arch.lane_idx()
        piece = lane % lpt
        sub = lane // lpt
        W = self.row_stride
        first = t0
        if cutlass.const_expr(self.coff == 2):
            first = t0 - self.ratio
        # This lane's piece: slot sub + j * spi of the warp's run (offsets for j = 0).
        grow = first * W + sub * W + (chunk - lane) * self.vec + piece * n16
        srow = (stage * (self.slots * self.threads * self.vec)
                + (sub * self.threads + thr - lane) * self.vec + piece * n16)
        # Where a copy instruction's slots all lie in one half of the window (spi divides
        # ratio), which half is known at compile time: no per-lane select.
        halves_static = self.coff == 1 or self.ratio % spi == 0
        for j in cutlass.range_constexpr((self.slots + spi - 1) // spi):
            k0 = j * spi
            if cutlass.const_expr(halves_static):
                own = self.coff == 1 or k0 >= self.ratio
                goff = self.slot_offset(k0)
                valid = Boolean(True) if own else has_prev
                if cutlass.const_expr((self.slots % spi) != 0 and k0 + spi > self.slots):
                    valid = valid & (sub + k0 < self.slots)
            else:
                k = sub + k0
                ownk = k >= self.ratio
                valid = (k < self.slots) & (ownk | has_prev)
                goff = k0 * W + (self.d if ownk else 0)
            if valid:
                # Every term is a multiple of a 16-byte piece: say so, or the copies lose
                # their width.
                g = cute.assume(grow + goff, divby=n16)
                sm = cute.assume(srow + k0 * (self.threads * self.vec), divby=n16)
                cute.copy(tt.atom, cute.make_tensor(tt.score.iterator + g, vl),
                          cute.make_tensor(tt.sS.iterator + sm, vl))
                cute.copy(tt.atom, cute.make_tensor(tt.kv.iterator + g, vl),
                          cute.make_tensor(tt.sV.iterator + sm, vl))

    @cute.jit
    def stage_guess(self, stage_row, row0, count, num_rows, num_tokens):
        """Stage 0 (the thread's first row, ``row0``) copied by ``stage_row(row, t0,
        has_prev, stage)`` at the window the row has where every segment before it is whole
        blocks from token 0 (first token ``row0 * ratio``), before the row walk has loaded
        any offset, so the copies' latency overlaps the walk's dependent loads. The previous
        block's slots are copied wherever they exist, so only the first token needs
        checking (fix_guess). Every thread that calls it has a row (count > 0 in the
        kernels that use it), so its copies are waited for in the row loop. Returns
        (guessed first token, copied)."""
        t0g = row0 * self.ratio
        has_prev_g = t0g >= self.ratio
        okg = (count > 0) & (row0 < num_rows) & in_bounds(t0g, has_prev_g, num_tokens,
                                                          self.ratio, self.coff)
        if okg:
            stage_row(row0, t0g, has_prev_g, Int32(0))
        cute.arch.cp_async_commit_group()
        return t0g, okg

    @cute.jit
    def fix_guess(self, stage_row, go, t0, has_prev, t0g, okg, row0):
        """After the walk: where row ``row0`` is computed (``go``) at a first token ``t0``
        other than the guess (or the guess copied nothing), wait for the guessed copies
        (the new ones write the same shared memory) and copy the true window."""
        if go & ((~okg) | (t0 != t0g)):
            cute.arch.cp_async_wait_group(0)
            stage_row(row0, t0, has_prev, Int32(0))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def prime_stages(self, issue, walk, row0, count, first: int = 0):
        """Start the staged row pipeline: ``issue(walk, row, stage)`` (a kernel's issue_row,
        returning the issuing walk) for the thread's first ``stages - 1`` rows of ``count``
        (``row_lanes`` apart from ``row0``), one commit group a stage; from stage ``first``
        where the stages before were issued otherwise (stage_guess)."""
        for p in cutlass.range_constexpr(first, self.stages - 1):
            if p < count:
                walk = issue(walk, row0 + p * self.row_lanes, p)
            cute.arch.cp_async_commit_group()
        return walk

    @cute.jit
    def advance_stages(self, issue, walk, row0, i, count):
        """Step ``i`` of the pipeline: issue row ``i + stages - 1`` into the stage row
        ``i - 1`` left, then wait until row ``i``'s stage has landed. Where the warp stages
        cooperatively (``coop``) lanes read each other's copies: a warp sync before the
        issue (the stage was read last step) and after the wait."""
        if cutlass.const_expr(self.coop):
            cute.arch.sync_warp()
        ahead = i + (self.stages - 1)
        if ahead < count:
            walk = issue(walk, row0 + ahead * self.row_lanes, ahead % self.stages)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(self.stages - 1)
        if cutlass.const_expr(self.coop):
            cute.arch.sync_warp()
        return walk

    @cute.jit
    def load_ape(self, tt: Tiles):
        """The thread's APE values of every slot into registers ``tt.apef`` (slots, vec):
        they are the same for every row the thread walks. Without an APE, one vector of
        the offsets guard's flag (0, or NaN for a malformed pack) for every slot."""
        if cutlass.const_expr(self.has_ape):
            for k in cutlass.range_constexpr(self.slots):
                _, colc, arow, _ = self.slot_coords(Int32(k), Int32(0), True, tt.chunk)
                a32 = tt.ape[(None, (arow, colc))].load()
                for e in cutlass.range_constexpr(self.vec):
                    tt.apef[k, e] = a32[e]
        else:
            f32 = tt.ape[(None, (Int32(0), tt.chunk))].load()
            for k in cutlass.range_constexpr(self.slots):
                for e in cutlass.range_constexpr(self.vec):
                    tt.apef[k, e] = f32[e]

    @cute.jit
    def ape_vec(self, tt: Tiles, arow, colc):
        """Slot row ``arow``'s APE vector at column chunk ``colc``; without an APE the
        guard's flag vector (row 0: every row holds the same flag)."""
        row = arow
        if cutlass.const_expr(not self.has_ape):
            row = Int32(0)
        return tt.ape[(None, (row, colc))].load()

    @cute.jit
    def read_staged(self, tt: Tiles, sf, vf, t0, has_prev, stage):
        """The staged window into fp32 registers (score + ape, value); empty slots get
        -inf / 0 (what load_slots gives). APE from registers ``tt.apef`` when there."""
        for k in cutlass.range_constexpr(self.slots):
            _, colc, arow, valid = self.slot_coords(Int32(k), t0, has_prev, tt.chunk)
            if valid:
                self.read_staged_slot(tt, sf, vf, k, colc, arow, stage)
            else:
                self.empty_slot(sf, vf, k)

    @cute.jit
    def read_staged_slot(self, tt: Tiles, sf, vf, k: int, colc, arow, stage):
        """Slot ``k`` of the staged window into ``sf`` (score + ape) and ``vf`` (value)."""
        s32 = self.staged_vector(tt.sS, k, stage, tt.thr)
        v32 = self.staged_vector(tt.sV, k, stage, tt.thr)
        apef = tt.apef
        if cutlass.const_expr(apef is None):
            a32 = self.ape_vec(tt, arow, colc)
            for e in cutlass.range_constexpr(self.vec):
                sf[k, e] = s32[e] + a32[e]
        else:
            for e in cutlass.range_constexpr(self.vec):
                sf[k, e] = s32[e] + apef[k, e]
        for e in cutlass.range_constexpr(self.vec):
            vf[k, e] = v32[e]

    @cute.jit
    def empty_slot(self, sf, vf, k: int):
        """Slot ``k`` of a window with no token: score -inf, value 0 (exp gives it weight 0)."""
        for e in cutlass.range_constexpr(self.vec):
            sf[k, e] = -Float32.inf
            vf[k, e] = Float32(0.0)

    @cute.jit
    def staged_vector(self, s, k, stage, thr):
        """This thread's staged vector of slot ``k`` in fp32."""
        if cutlass.const_expr(self.bf16_bits):
            return widen_bf16(s[(None, thr, k, stage)], self.vec)
        else:
            return s[(None, thr, k, stage)].load().to(Float32)

    @cute.jit
    def slot_coords(self, k, t0, has_prev, chunk):
        """(token, column chunk, ape row, non-empty) of window slot k."""
        ratio = self.ratio
        if cutlass.const_expr(self.coff == 2):
            own = k >= ratio
            colc = chunk + (Int32(self.cpr) if own else Int32(0))
            arow = k - (Int32(ratio) if own else Int32(0))
            return t0 - ratio + k, colc, arow, own | has_prev
        else:
            return t0 + k, chunk, k, k >= 0

    @cute.jit
    def load_slots(self, tt: Tiles, sf, vf, c0, t0, has_prev):
        """Slots ``c0 ..`` (chunk_slots of them) of the window from global memory into fp32
        registers (score + ape, value); empty slots get -inf / 0."""
        for kk in cutlass.range_constexpr(self.chunk_slots):
            tok, colc, arow, valid = self.slot_coords(c0 + kk, t0, has_prev, tt.chunk)
            if valid:
                s32 = tt.score[(None, (tok, colc))].load().to(Float32)
                a32 = self.ape_vec(tt, arow, colc)
                v32 = tt.kv[(None, (tok, colc))].load().to(Float32)
                for e in cutlass.range_constexpr(self.vec):
                    sf[kk, e] = s32[e] + a32[e]
                    vf[kk, e] = v32[e]
            else:
                self.empty_slot(sf, vf, kk)
