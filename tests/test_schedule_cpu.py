"""Host-side launch schedules (CPU): every row and token is covered, the forward grid is one
wave, and staging fits the SM. The kernels' index arithmetic mirrors these formulas."""

import dataclasses
import math

import pytest

cutlass = pytest.importorskip("cutlass")

import torch  # noqa: E402

from csa_compressor.kernels import hardware, launch, tuning  # noqa: E402
from csa_compressor.kernels.compile import Compiled  # noqa: E402

T = tuning.current()
from csa_compressor.kernels.pool_bwd import PoolBackward  # noqa: E402
from csa_compressor.kernels.pool_fwd import PoolForward  # noqa: E402
from csa_compressor.kernels.pool_long import LongPoolBackward, LongPoolForward  # noqa: E402

SMS = 132  # H200
FWD = [(cutlass.BFloat16, 4, 2, 512), (cutlass.BFloat16, 4, 2, 128), (cutlass.BFloat16, 2, 2, 512),
       (cutlass.BFloat16, 4, 1, 65), (cutlass.Float32, 8, 2, 64), (cutlass.Float16, 1, 1, 8)]
ROWS = [1, 7, 511, 2048, 6144, 24576, 10**6]


@pytest.mark.parametrize("cfg", FWD, ids=[f"{c[0].__name__}-r{c[1]}-c{c[2]}-d{c[3]}" for c in FWD])
@pytest.mark.parametrize("rows", ROWS)
def test_forward_grid_covers_rows_in_one_wave(cfg, rows):
    k = PoolForward(*cfg)
    per = k.rows_per_thread(rows, SMS)
    assert 1 <= per <= T.FWD_MAX_ROWS_PER_THREAD
    grid_x = math.ceil(rows / (per * k.row_lanes))  # PoolForward.__call__
    assert grid_x * per * k.row_lanes >= rows
    if per < T.FWD_MAX_ROWS_PER_THREAD:
        assert grid_x * k.col_groups <= SMS * k.target_ctas_per_sm


@pytest.mark.parametrize("cfg", FWD, ids=[f"{c[0].__name__}-r{c[1]}-c{c[2]}-d{c[3]}" for c in FWD])
def test_forward_staging_fits_the_sm(cfg):
    k = PoolForward(*cfg)
    assert k.staged == (k.vec * cfg[0].width // 8 in (4, 8, 16))
    if k.staged:
        assert k.stages >= 2
    assert k.target_ctas_per_sm * (k.smem_bytes + hardware.SMEM_RESERVED_PER_CTA) <= hardware.SMEM_PER_SM


BWD = [(PoolBackward, cutlass.BFloat16, 4, 2, 512), (PoolBackward, cutlass.BFloat16, 4, 2, 128),
       (PoolBackward, cutlass.BFloat16, 3, 1, 65), (LongPoolBackward, cutlass.BFloat16, 128, 1, 512),
       (LongPoolBackward, cutlass.BFloat16, 16, 2, 64)]


@pytest.mark.parametrize("cfg", BWD, ids=[f"{c[0].__name__}-r{c[2]}-c{c[3]}-d{c[4]}" for c in BWD])
@pytest.mark.parametrize("rows,tokens", [(1, 4), (61, 300), (2048, 8192), (6144, 24576), (0, 5), (3, 10**5)])
def test_backward_schedule_covers_rows_and_tokens(monkeypatch, cfg, rows, tokens):
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    cls, *args = cfg
    k = cls(*args)
    per_cta, row_ctas, zero_ctas = launch.backward_schedule(rows, tokens, k, torch.device("cuda", 0))
    assert per_cta >= 1 and row_ctas * per_cta >= rows
    # zero CTA b, row lane y walks tokens (b*row_lanes + y)*Z .. +Z-1 (pool_bwd/pool_long)
    assert zero_ctas * k.row_lanes * T.ZERO_TOKENS_PER_THREAD >= tokens
    assert (zero_ctas - 1) * k.row_lanes * T.ZERO_TOKENS_PER_THREAD < max(tokens, 1)


@pytest.mark.parametrize("d", [64, 128, 512])
def test_large_pack_backward_variant(monkeypatch, d):
    """Where the backward stacks row lanes (d <= 128 bf16) it has a large-pack variant with
    the cooperative copies, whose grid is one wave of one CTA an SM fewer than the default
    and whose shared memory fits them; one row lane (d=512) needs none."""
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    small = PoolBackward(cutlass.BFloat16, 4, 2, d)
    assert small.has_large_variant == (small.row_lanes > 1) == (d < 512)
    assert not LongPoolBackward(cutlass.BFloat16, 128, 1, d).has_large_variant
    if not small.has_large_variant:
        return
    large = PoolBackward(cutlass.BFloat16, 4, 2, d, large=True)
    assert large.coop and not small.coop and not large.has_large_variant
    assert large.target_ctas_per_sm == small.target_ctas_per_sm - 1 == 2
    assert large.target_ctas_per_sm * (large.smem_bytes + hardware.SMEM_RESERVED_PER_CTA) <= hardware.SMEM_PER_SM
    for rows in (4096, 6144, 32768):
        per_cta, row_ctas, _ = launch.backward_schedule(rows, 4 * rows, large, torch.device("cuda", 0))
        assert row_ctas * per_cta >= rows and row_ctas <= SMS * large.target_ctas_per_sm
    # sm_100 keeps one variant (its register bound spilled at d=512)
    assert not PoolBackward(cutlass.BFloat16, 4, 2, d, arch_major=10).has_large_variant


@pytest.mark.parametrize("ratio,coff,d,has", [(4, 2, 128, True), (4, 2, 64, True),
                                              (3, 2, 128, True), (6, 1, 128, True),
                                              (1, 1, 128, True), (5, 1, 128, True),
                                              (1, 2, 64, True), (2, 2, 128, True),
                                              (4, 1, 128, True), (8, 2, 128, False)])
def test_large_pack_variant_only_where_it_measured_faster(ratio, coff, d, has):
    """The large-pack variant exists where it costs one or two CTAs an SM (H200: faster at
    3 -> 2, ratio 4 coff 2 at d=128 and 64, at 8c7ee81; 4 -> 3, ratio 3 coff 2, at ec3f8c9;
    5 -> 4 and 6 -> 5, ratios 1 and 5 coff 1, at 93dea79; 6 -> 4, ratio 2 coff 2 and ratio 4
    coff 1, whose windows spill at 5, at d7a615e; 2 CTAs were slower at 8c7ee81), and not
    where it trades nothing (ratio 8 coff 2: shared memory holds 1)."""
    small = PoolBackward(cutlass.BFloat16, ratio, coff, d)
    assert small.has_large_variant == has
    if has:
        large = PoolBackward(cutlass.BFloat16, ratio, coff, d, large=True)
        fewer = small.target_ctas_per_sm - large.target_ctas_per_sm
        assert fewer == (2 if (ratio, coff) in ((2, 2), (4, 1)) else 1)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (3, 2), (6, 1), (5, 1), (3, 1), (2, 2),
                                        (1, 1), (8, 2)])
@pytest.mark.parametrize("guess_rows", [None, 2048])
def test_large_pack_threshold_follows_the_first_row_guess(monkeypatch, ratio, coff, guess_rows):
    """The large-pack variants that copy their first row at a guess (sm_90, 3 CTAs an SM or
    fewer: ratio 4 and 3 coff 2, ratio 6 coff 1) are taken from the smaller of
    BWD_LARGE_PACK_ROWS and BWD_LARGE_GUESS_PACK_ROWS rows (as shipped, and at the
    candidate's 2,048), the others from BWD_LARGE_PACK_ROWS. The default d=512 backward
    guesses too; the stacked default and sm_100 do not. The long backward (ratio 128) has
    neither and still picks (its missing attribute failed the bench at f9c11e4)."""
    t = T if guess_rows is None else dataclasses.replace(T, BWD_LARGE_GUESS_PACK_ROWS=guess_rows)
    small = PoolBackward(cutlass.BFloat16, ratio, coff, 128, tuning=t)
    guesses = (ratio, coff) in ((4, 2), (3, 2), (6, 1))
    assert small.large_guesses == guesses and not small.guess_first
    if small.has_large_variant:
        assert PoolBackward(cutlass.BFloat16, ratio, coff, 128, large=True).guess_first == guesses
    assert PoolBackward(cutlass.BFloat16, ratio, coff, 512).guess_first
    assert not PoolBackward(cutlass.BFloat16, ratio, coff, 512, arch_major=10).guess_first

    picked = []
    kernel = small

    def compiled_for(spec, device):
        picked.append(spec.direction)
        large = (Compiled(PoolBackward(cutlass.BFloat16, ratio, coff, 128, large=True), None, None,
                          None) if kernel.has_large_variant else None)
        return Compiled(kernel, None, None, None, large=large)

    monkeypatch.setattr(launch, "compiled_for", compiled_for)
    dev = torch.device("cuda", 0)
    threshold = t.BWD_LARGE_PACK_ROWS
    if guesses:
        threshold = min(threshold, t.BWD_LARGE_GUESS_PACK_ROWS)
    for rows in (threshold - 1, threshold, t.BWD_LARGE_PACK_ROWS):
        picked.clear()
        got = launch.backward_kernel(dev, torch.bfloat16, ratio, coff, 128, rows, tuning=t)
        want = small.has_large_variant and rows >= threshold
        assert picked == ["bwd"] and (got.kernel is not kernel) == want, rows
    kernel = LongPoolBackward(cutlass.BFloat16, 128, 1, 128)
    picked.clear()
    assert launch.backward_kernel(dev, torch.bfloat16, 128, 1, 128, 1 << 20).kernel is kernel
    assert picked == ["bwd"]


@pytest.mark.parametrize("d", [128, 512])
def test_production_forward_runs_the_measured_occupancy(d):
    # The measured grids (docs/lab/tuning-log.md): d=512 (8-byte vectors) 4 CTAs per SM (ncu:
    # shared-memory limit 4); d=128 (4-byte vectors) the register bound's 8 on sm_90.
    k = PoolForward(cutlass.BFloat16, 4, 2, d)
    want = T.FWD_TARGET_CTAS_PER_SM if d == 512 else T.fwd_bound_ctas(9)
    assert k.target_ctas_per_sm == want == (4 if d == 512 else 8)


@pytest.mark.parametrize("d", [128, 512])
def test_backward_grid_fits_one_wave_of_resident_ctas(monkeypatch, d):
    """The backward's row CTAs fit in one wave of the CTAs whose shared memory an SM holds
    (at d=128 three, where BWD_TARGET_CTAS_PER_SM is 4)."""
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    k = PoolBackward(cutlass.BFloat16, 4, 2, d)
    fit = hardware.SMEM_PER_SM // (k.smem_bytes + hardware.SMEM_RESERVED_PER_CTA)
    assert 1 <= k.target_ctas_per_sm <= min(fit, T.BWD_TARGET_CTAS_PER_SM)
    for rows in (2048, 6144, 24576):
        _, row_ctas, _ = launch.backward_schedule(rows, 4 * rows, k, torch.device("cuda", 0))
        assert row_ctas * k.col_groups <= SMS * fit


def test_backward_grid_interleaves_column_groups():
    """Column groups are the fastest index of a 1-D grid, so every row CTA is dispatched
    before any zero CTA; kernels with one column group keep a plain grid."""
    wide = PoolBackward(cutlass.BFloat16, 4, 2, 512)
    assert wide.col_groups == 2 and wide.grid(1000) == [2000, 1, 1]
    narrow = PoolBackward(cutlass.BFloat16, 4, 2, 128)
    assert narrow.col_groups == 1 and narrow.grid(1000) == [1000, 1, 1]


def test_backward_row_ctas_fit_one_wave_at_d512(monkeypatch):
    """At d=512 the row CTAs of both column groups are resident at once: 6 CTAs of 128
    threads an SM (80 registers, ptxas), as the 39ce8aa sweep measured."""
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    k = PoolBackward(cutlass.BFloat16, 4, 2, 512)
    assert k.target_ctas_per_sm == 6
    _, row_ctas, _ = launch.backward_schedule(6144, 24576, k, torch.device("cuda", 0))
    assert row_ctas * k.col_groups <= SMS * 6


@pytest.mark.parametrize("dtype,d,want_bytes", [
    (cutlass.BFloat16, 512, 8), (cutlass.BFloat16, 256, 8), (cutlass.BFloat16, 128, 4),
    (cutlass.BFloat16, 64, 4), (cutlass.BFloat16, 32, 2), (cutlass.BFloat16, 65, 2),
    (cutlass.Float32, 128, 8), (cutlass.Float32, 64, 4), (cutlass.Float16, 128, 4)])
def test_forward_vector_width_follows_chunks_per_row(dtype, d, want_bytes):
    """The forward's vector: 8 B where a row still has 64 chunks, halved towards 64 chunks
    but not below 4 B (cp.async), and below that only where head_dim forces it (d=65) or a
    warp would not be filled by one row (d=32: MIN_CHUNKS_PER_ROW)."""
    k = PoolForward(dtype, 4, 2, d)
    assert k.vec * dtype.width // 8 == want_bytes
    assert d % k.vec == 0


@pytest.mark.parametrize("arch_major,sms", [(9, 132), (10, 148)])
def test_register_bound_gives_one_row_a_thread_at_1x8192_d128(arch_major, sms):
    """FWD_BOUND_CTAS_PER_SM: the 4-byte forward at d=128 is bounded to the arch's
    CTAs an SM, sized for them (one row a thread for 2,048 rows in one wave), and holds its
    staging in the carveout; so is the unstaged 2-byte forward of d=65; 8-byte forwards
    (d=512) are left alone."""
    k = PoolForward(cutlass.BFloat16, 4, 2, 128, arch_major)
    assert k.min_ctas == T.fwd_bound_ctas(arch_major) == k.target_ctas_per_sm
    assert k.rows_per_thread(2048, sms) == 1
    assert math.ceil(2048 / k.row_lanes) <= sms * k.min_ctas  # one wave
    assert k.carveout * hardware.SMEM_PER_SM / 100 >= k.min_ctas * (k.smem_bytes + hardware.SMEM_RESERVED_PER_CTA)
    wide = PoolForward(cutlass.BFloat16, 4, 2, 512, arch_major)
    assert wide.min_ctas == 0 and wide.carveout is None
    odd = PoolForward(cutlass.Float16, 3, 2, 65, arch_major)
    assert not odd.staged and odd.min_ctas == T.fwd_bound_ctas(arch_major)


@pytest.mark.parametrize("ratio,coff,d,tokens,wide", [
    (128, 1, 512, 3 * 8192, True),  # 16 partial rows of 65,536 columns (measured faster wide)
    (128, 1, 128, 8192, False),  # 64 rows of 16,384 (measured faster in the default layout)
    (128, 1, 512, 128, True),  # one row
    (4, 2, 512, 3 * 8192, False),  # 4,096 columns: too few for the wide layout
    (4, 2, 128, 64, False),
])
def test_dape_sum_layout_follows_the_partials(monkeypatch, ratio, coff, d, tokens, wide):
    """The backward's dape sum takes the wide layout for few partial rows of many columns
    (REDUCE_WIDE_*), as the sweep at 748cd3e measured, chosen from the schedule."""
    monkeypatch.setattr(launch, "sm_count", lambda index: SMS)
    cls = LongPoolBackward if T.long_window(ratio * coff) else PoolBackward
    k = cls(cutlass.BFloat16, ratio, coff, d)
    _, row_ctas, _ = launch.backward_schedule(tokens // ratio, tokens, k, torch.device("cuda", 0))
    c = Compiled(k, None, None, None, "default", "wide" if T.dape_has_wide(ratio * coff * d) else None)
    assert launch.dape_sum(c, row_ctas) == ("wide" if wide else "default")


@pytest.mark.parametrize("cls,ratio,coff,d,free", [
    ("fwd", 128, 1, 512, True), ("fwd", 128, 1, 128, True), ("bwd", 128, 1, 512, True),
    ("bwd", 128, 2, 512, True), ("bwd", 128, 1, 128, True),
    ("fwd", 128, 2, 512, False),  # two slot groups a warp, old columns (docs/lab/tuning-long.md, "Split shared columns")
])
def test_long_kernels_shared_stores_and_sums_avoid_bank_conflicts(cls, ratio, coff, d, free):
    """The long kernels' shared buffer (pool_long.LongWindow): a warp's stores of one slot
    (each thread its own column and slot group) and the serial sums' loads (threads g <
    vec of each chunk lane, one column each) touch 32 different banks where designed."""
    k = (LongPoolForward if cls == "fwd" else LongPoolBackward)(cutlass.BFloat16, ratio, coff, d)
    threads = [(t, g) for g in range(k.groups) for t in range(k.lanes)]  # x fastest
    stores = serial = True
    for w in range(0, len(threads), 32):
        warp = threads[w:w + 32]
        for e in range(k.vec):
            for s in range(k.chunk_slots):
                banks = {(k.col(t, e) + (g * k.chunk_slots + s) * k.slot_stride) % 32 for t, g in warp}
                stores &= len(banks) == len(warp)
        readers = [(t, g) for t, g in warp if g < k.vec]
        if readers:
            serial &= len({k.col(t, g) % 32 for t, g in readers}) == len(readers)
    assert serial
    assert stores == free
