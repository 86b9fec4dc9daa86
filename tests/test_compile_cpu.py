"""Compile-only checks of the kernels for sm_90a and sm_100a on a CPU machine (CI).

Each production configuration is compiled in a subprocess; what ptxas reports and the PTX
must show: no local-memory spills or stack, the pinned ``mul.rn.f32`` present, the shared
reciprocal of the division present, the main loads as wide as the tuning designs them, the
programmatic-dependent wait before any global memory access where the launch uses PDL,
and the narrow forward's register bound.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")
pytestmark = pytest.mark.compile

from csa_compressor.kernels import hardware, tuning  # noqa: E402

T = tuning.current()

HERE = os.path.dirname(__file__)
CONFIGS = [  # (direction, dtype, ratio, coff, head_dim)
    ("fwd", "bfloat16", 4, 2, 512), ("bwd", "bfloat16", 4, 2, 512),
    ("fwd", "bfloat16", 4, 2, 128), ("bwd", "bfloat16", 4, 2, 128),
    ("bwd_large", "bfloat16", 4, 2, 128),
    ("fwd", "bfloat16", 128, 1, 512), ("bwd", "bfloat16", 128, 1, 512),
]


def regs_for_one_wave(info):
    """Registers x threads x CTAs an SM of the grid's wave (ptxas allocates registers in
    eights): at most the SM's 64K, or the last CTAs wait for a second wave."""
    regs = -(-max(info["regs"]) // 8) * 8
    return regs * info["threads"] * info["target_ctas"]


def probe(arch, cfg, overrides=""):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CSA_CONFIG=overrides,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("CSA_COMPRESSOR_CACHE_DIR", None)  # the probe reads what ptxas says of a compile
    res = subprocess.run([sys.executable, os.path.join(HERE, "compile_probe.py"), *map(str, cfg)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["-".join(map(str, c)) for c in CONFIGS])
def test_compiles_without_spills_and_with_pinned_rounding(arch, cfg):
    info = probe(arch, cfg)
    if info.get("absent"):
        # sm_100 has no large-pack backward (its cooperative copies are sm_90-only), and
        # that is the only kernel of the grid a plan may lack
        assert cfg[0] == "bwd_large" and arch == "sm_100a", cfg
        return
    assert info["regs"], "ptxas reported no register count"
    # The grid sizing reads the register count from the cubin (compile.cubin_registers):
    # it must be ptxas' own, and the production kernels' grids are what they were designed
    # for (their registers fit it; see regs_for_one_wave below).
    assert info["cubin_regs"] == max(info["regs"]), info
    assert all(s == 0 for s in info["spills"]), info
    assert all(s == 0 for s in info["stack"]), info
    assert info["local"] == 0, info
    assert info["mul_rn"] >= info["vec"], info
    assert info["smem_used"] <= info["smem_asked"], info
    direction, _, ratio, coff, d = cfg
    width = info["vec"] * info["elem_bytes"]
    # Every window slot reads kv and score with one vector of the designed width: a
    # cp.async into shared memory in the short-window kernels, a load in the long ones.
    # Where the warp stages its window cooperatively (staging.stage_window_warp: the
    # forwards, and on sm_90 the backward with one row lane and the large-pack backward),
    # the window's copies are 16-byte pieces instead, 32 vectors of a slot shared out over
    # the warp.
    staged = ratio * coff <= 16
    arch_major = int(arch[3:-1]) // 10
    coop = staged and (direction == "fwd" or (arch_major == 9 and (d == 512 or direction == "bwd_large")))
    assert info["coop"] == coop, info
    reads = info["async_copies_by_bytes" if staged else "loads_by_bytes"]
    if not staged:
        # The long backward copies its values by cp.async (pool_long.LongPoolBackward).
        copies = info["async_copies_by_bytes"]
        reads = {b: reads.get(b, 0) + copies.get(b, 0) for b in {*reads, *copies}}
    if coop:
        pieces = -(-info["slots"] * width // 16)  # 16-byte copies a lane and row, per tensor
        assert reads.get("16", 0) >= 2 * pieces, info
    else:
        assert reads.get(str(width), 0) >= 2 * info["chunk_slots"], info
    # One shared reciprocal per column instead of a division per slot (softmax.div_rn).
    assert info["rcp_rn"] >= 1, info

    designed = T.VEC_BYTES if direction == "fwd" else T.BWD_VEC_BYTES  # bwd, bwd_large
    if direction == "fwd" and d == 128:
        # 32 chunks of 8 B a row: halved to 64 chunks (FWD_MIN_CHUNKS_PER_ROW).
        designed = T.FWD_MIN_VEC_BYTES
    if ratio > 8:
        designed = T.LONG_VEC_BYTES if direction == "fwd" else T.LONG_BWD_VEC_BYTES
    assert width == designed, info  # head_dim 512/128 bf16 allow the designed width
    # The short-window kernels' warps are 32 column lanes of one row, so the first segment
    # search of a walk is the warp-wide one (segments.find_segment_warp). (The long backward's
    # slot groups are 16 lanes wide: binary search there.)
    if staged:
        assert info["ballots"] >= 1, info
    # Launched as programmatic dependents (pool_fwd / pool_bwd / pool_long, use_pdl): the
    # wait must come before any global memory access, or a kernel could read inputs its
    # predecessor is still writing.
    assert info["pdl_wait"] and info["pdl_wait_first"], info
    if staged:
        # The grid is sized for one wave of target_ctas CTAs an SM (launch.py, pool_fwd
        # rows_per_thread): their registers must fit the SM's 64K, or the last CTAs wait
        # for a second wave (the backward's grid for more CTAs than fit ran 1.3 waves:
        # 1x8192/128 fwd+bwd 27.9 against 24.6 us, docs/lab/tuning-log.md). The d=512 forward sits at
        # the limit: 128 registers x 128 threads x 4 CTAs.
        assert regs_for_one_wave(info) <= 65536, info
        assert info["grid_ctas"] == info["target_ctas"], info
    if direction == "fwd" and width <= 4 and staged:
        # The narrow forward's register bound (FWD_BOUND_CTAS_PER_SM).
        assert info["min_ctas"] == [T.fwd_bound_ctas(arch_major)], info
    elif direction in ("bwd", "bwd_large") and coop:
        # The cooperative backward is held to the registers of the CTAs its grid is sized
        # for (pool_bwd.py: unbounded, ptxas took a register too many for one wave).
        assert info["min_ctas"] == [info["target_ctas"]] and info["target_ctas"] >= 1, info
    elif direction == "bwd" and not staged:
        # The long backward is compiled for the CTAs its grid is sized for
        # (LONG_BWD_CTAS_PER_SM at d=512's 16 slots a thread): unbounded it took 101
        # registers, one CTA an SM.
        assert info["min_ctas"] == [T.LONG_BWD_CTAS_PER_SM] == [info["target_ctas"]], info
    else:
        assert info["min_ctas"] == [], info


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [("fwd", "bfloat16", 4, 2, 512), ("bwd", "bfloat16", 4, 2, 128),
                                 ("bwd", "bfloat16", 128, 1, 512)],
                         ids=lambda c: "-".join(map(str, c)))
def test_the_packed_layout_compiles_to_the_same_resources(arch, cfg):
    """kv and score as the halves of one [kv | score] tensor (rows 2*coff*d apart, a
    compile-time stride): the same registers, no spills, the same copies and grid as the
    packed rows' kernel."""
    plain = probe(arch, cfg)
    packed = probe(arch, (*cfg, 2 * cfg[3] * cfg[4]))
    assert all(s == 0 for s in packed["spills"]) and packed["local"] == 0, packed
    for key in ("regs", "coop", "async_copies_by_bytes", "loads_by_bytes", "target_ctas",
                "min_ctas", "smem_asked", "mul_rn", "pdl_wait_first"):
        assert packed[key] == plain[key], (key, packed[key], plain[key])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("layout,ratio,coff,d", [("dape", 4, 2, 512), ("dape_wide", 128, 1, 512)])
def test_dape_reduction_compiles_with_wide_loads(arch, layout, ratio, coff, d):
    """The partials' reduction in both layouts: no spills, and 16-byte loads, unrolled."""
    info = probe(arch, (layout, "float32", ratio, coff, d))
    assert all(s == 0 for s in info["spills"]) and info["local"] == 0, info
    assert info["vec"] == 4 and info["loads_by_bytes"].get("16", 0) >= 2, info
    # Always a programmatic dependent of the backward: it must wait before reading.
    assert info["pdl_wait"] and info["pdl_wait_first"], info


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("ratio", [5, 8])
def test_wide_narrow_forwards_go_unbounded_without_spills(arch, ratio):
    """bf16 windows of more than FWD_BOUND_MAX_ELEMS elements a thread (coff 2,
    ratios 5-8) spilled 32-232 B under the narrow forward's register bound; they compile
    unbounded and spill-free (the 22a19a6 sweep measured them 1-6 us faster)."""
    info = probe(arch, ("fwd", "bfloat16", ratio, 2, 128))
    assert info["min_ctas"] == [], info
    assert all(s == 0 for s in info["spills"]) and info["local"] == 0, info


# Kernels that tools/spill_survey.py found spilling under a register bound, or with a
# grid sized for more CTAs than their registers hold (FWD_BOUND_SPILLS,
# BWD_COOP_MAX_CTAS, GRID_FITS_REGISTERS, FWD_MAX_WINDOW_ELEMS): (arch, cfg, the bound
# expected, whether the grid is smaller than designed).
SURVEY_FIXES = [
    ("sm_90a", ("fwd", "bfloat16", 6, 1, 128), [], False),
    ("sm_100a", ("fwd", "bfloat16", 8, 1, 128), [], False),
    ("sm_90a", ("bwd", "bfloat16", 6, 2, 512), [4], False),
    ("sm_90a", ("bwd", "bfloat16", 7, 2, 512), [4], False),
    ("sm_90a", ("bwd", "bfloat16", 9, 1, 512), [5], False),
    ("sm_90a", ("bwd", "bfloat16", 12, 1, 512), [4], False),
    ("sm_90a", ("bwd", "bfloat16", 4, 1, 128), [], True),
    ("sm_90a", ("fwd", "bfloat16", 5, 2, 512), [], True),
    ("sm_100a", ("bwd", "bfloat16", 7, 2, 512), [], True),
]


@pytest.mark.parametrize("arch,cfg,bound,smaller", SURVEY_FIXES,
                         ids=[f"{a}-" + "-".join(map(str, c)) for a, c, _, _ in SURVEY_FIXES])
def test_survey_fixes_compile_spill_free_for_one_wave(arch, cfg, bound, smaller):
    """Spill-free, with the bound named, and a grid no larger than the compiled kernel's
    registers hold (fewer CTAs than designed where the design overshot them)."""

    info = probe(arch, cfg)
    assert all(s == 0 for s in info["spills"]) and info["local"] == 0, info
    assert info["min_ctas"] == bound, info
    fits = hardware.ctas_fitting_registers(info["cubin_regs"], info["threads"])
    assert 1 <= info["grid_ctas"] <= fits, info
    assert (info["grid_ctas"] < info["target_ctas"]) == smaller, info


@pytest.mark.parametrize("ratio,vec", [(4, 4), (5, 4), (6, 2), (8, 2)])
def test_wide_forward_windows_take_half_vectors(ratio, vec):
    """d=512 bf16 forwards of windows over FWD_MAX_WINDOW_ELEMS elements a thread
    (coff 2, ratios 6-8) take 4-byte vectors, spill-free and unbounded; ratios 4 and 5 keep
    8 bytes. In 8-byte vectors ratios 6-8 took 207-254 registers, 2 CTAs an SM."""

    info = probe("sm_90a", ("fwd", "bfloat16", ratio, 2, 512))
    assert info["vec"] == vec, info
    assert all(s == 0 for s in info["spills"]) and info["local"] == 0 and info["min_ctas"] == [], info
    if vec == 2:
        assert hardware.ctas_fitting_registers(info["cubin_regs"], info["threads"]) >= info["target_ctas"] == 4, info


def test_ctas_fitting_registers_follows_the_occupancy_rule():
    """Registers go to warps in units of 256, whole warps a partition (of 4): e.g. 56
    registers x 256 threads leave 4 CTAs (the ratio 4 coff 1 d=128 backward), 79-80 x 128
    leave 6 (the d=512 backward's grid), 96 x 128 leave 5, 255 x 128 leave 2."""

    cases = {(56, 256): 4, (64, 256): 4, (32, 256): 8, (80, 128): 6, (79, 128): 6,
             (96, 128): 5, (128, 128): 4, (168, 128): 3, (255, 128): 2, (24, 64): 32, (16, 32): 32}
    for (regs, threads), ctas in cases.items():
        assert hardware.ctas_fitting_registers(regs, threads) == ctas, (regs, threads)


def test_cubin_reader_declines_what_is_not_a_cubin():
    from csa_compressor.kernels.compile import cubin_registers

    assert cubin_registers(None) is None and cubin_registers(b"") is None
    assert cubin_registers(b"\x7fELF\x02" + b"\0" * 10) is None  # truncated header
    assert cubin_registers(b"MZ" + b"\0" * 100) is None


# Buffers whose sizes are not multiples of their 16-byte alignment (odd thread counts and
# slot counts), where padding between allocations adds up.
ODD_CONFIGS = [("bwd", "float32", 4, 2, 65), ("fwd", "float32", 3, 1, 65),
               ("bwd", "bfloat16", 3, 1, 65)]


@pytest.mark.parametrize("cfg", ODD_CONFIGS, ids=["-".join(map(str, c)) for c in ODD_CONFIGS])
def test_launch_asks_for_the_shared_memory_the_kernel_uses(cfg):
    """The launch's shared memory covers every allocation the kernel makes, alignment
    padding included (summed bare, the fp32 d=65 backward asked for 46,020 bytes and used
    46,032; compute-sanitizer caught a 4-byte overrun of the same kind in a candidate)."""
    info = probe("sm_90a", cfg)
    assert 0 < info["smem_used"] <= info["smem_asked"], info


LARGE_CASES = [("bfloat16", 128, r, c) for r, c in
               ((4, 2), (8, 1), (3, 2), (6, 1), (5, 1), (1, 1), (3, 1), (1, 2), (4, 1), (2, 2))]
LARGE_CASES += [("float32", 64, 5, 1), ("float32", 64, 2, 2), ("float32", 64, 7, 1)]


@pytest.mark.parametrize("dtype,d,ratio,coff", LARGE_CASES)
def test_large_pack_backward_compiles_for_one_wave(dtype, d, ratio, coff):
    """The large-pack backward, sm_90a, bf16 at d=128 at each step it takes (3 -> 2 CTAs:
    ratio 4 coff 2, ratio 8 coff 1; 4 -> 3: ratio 3 coff 2, ratio 6 coff 1; 5 -> 4: ratio 5
    coff 1; 6 -> 5: ratios 1 and 3 coff 1, ratio 1 coff 2; the largest windows of each
    within BWD_LARGE_MAX_SLOTS; 6 -> 4: ratio 4 coff 1, ratio 2 coff 2), and fp32
    at d=64, whose defaults differ (ratio 7 coff 1: 4 -> 3): cooperative copies, no
    spills, held to registers for one wave of its CTAs."""
    info = probe("sm_90a", ("bwd_large", dtype, ratio, coff, d))
    assert info["coop"] and all(s == 0 for s in info["spills"]) and info["local"] == 0, info
    assert info["min_ctas"] == [info["target_ctas"]], info
    assert regs_for_one_wave(info) <= 65536, info


def test_compile_cache_keys_on_the_tuning():
    """get_kernel, compiling here for sm_90a: a backward brings its dape sum and its
    large-pack variant; a variant tuning compiles its own kernels, a launch-only change
    reuses them."""
    code = """
import torch
from csa_compressor.kernels import compile as cc, tuning
dev = torch.device("cpu")
b = cc.get_kernel("bwd", dev, torch.bfloat16, 4, 2, 128)
assert b.dape is not None and b.registers and b.ctas_per_sm <= b.kernel.target_ctas_per_sm
assert b.kernel.has_large_variant and len(cc._CACHE) == 3, sorted(k[0] for k in cc._CACHE)
f = cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128)
assert cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128) is f
t = tuning.replace(tuning.current(), BWD_LARGE_PACK_ROWS=0, FWD_MAX_ROWS_PER_THREAD=2)
assert cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128, t) is f
g = cc.get_kernel("fwd", dev, torch.bfloat16, 4, 2, 128, tuning.replace(tuning.current(), FWD_STAGES=3))
assert g is not f and g.kernel.t.FWD_STAGES == 3
print("ok")
"""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [("fwd", "bfloat16", 4, 2, 512, 3), ("bwd", "bfloat16", 4, 2, 512, 3),
                                 ("fwd", "bfloat16", 4, 2, 128, 3), ("bwd", "bfloat16", 128, 1, 512, 2)],
                         ids=lambda c: "-".join(map(str, c)))
def test_the_sbhd_kernels_compile_spill_free_with_the_thd_copies(arch, cfg):
    """SBHD inputs (B sequences interleaved token by token, one a grid.z index): the token
    rows B*coff*d apart, the output rows B*d apart; no spills or local memory, the same
    copies, staging and designed CTAs as the THD kernel, one grid.z index a sequence."""
    *thd, batch = cfg
    plain = probe(arch, thd)
    sbhd = probe(arch, (*thd, batch * cfg[3] * cfg[4], batch))
    assert all(s == 0 for s in sbhd["spills"]) and sbhd["local"] == 0, sbhd
    for key in ("coop", "async_copies_by_bytes", "target_ctas", "smem_asked", "mul_rn",
                "pdl_wait_first"):
        assert sbhd[key] == plain[key], (key, sbhd[key], plain[key])
    assert sbhd["min_ctas"] == [], sbhd  # unbounded: the grid follows its registers
    assert sbhd["grid_ctas"] * sbhd["threads"] * (-(-max(sbhd["regs"]) // 8) * 8) <= 65536


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_epilogue_row_kernels_compile_spill_free(arch):
    """kernels.epilogue_rows, forward and backward, at the Compressor's geometries (head_dim
    128 with rotation, 512 without, both rotary layouts, rope_dim 0, fp32; an fp32 weight
    beside bf16 rows), with and without the norm's math, kernels.rope_angles, kernels.offsets,
    kernels.column_sum, kernels.prefill_tail, kernels.decode_entries and
    kernels.prefill_offsets: they compile, with no spills or stack."""
    specs = ["bfloat16:128:64:1:1:0", "bfloat16:128:64:1:1:1", "bfloat16:512:64:1:0:0",
             "bfloat16:512:64:1:0:1", "bfloat16:128:64:0:1:0", "bfloat16:128:64:0:1:1",
             "bfloat16:256:0:1:1:1", "float16:256:0:1:1:0", "float32:512:512:1:1:0",
             # with the norm's own math (statistics forward, its backward)
             "bfloat16:128:64:1:1:0:1", "bfloat16:128:64:0:1:1:1", "bfloat16:512:64:1:0:0:1",
             "bfloat16:512:64:1:0:1:1", "bfloat16:192:0:1:0:1:1", "float32:64:32:1:0:1:1",
             "float32:32:0:1:1:0:1", "float32:32:0:1:1:1:0",  # one value a lane, no table
             "bfloat16:96:0:1:0:0:1", "bfloat16:160:0:1:0:1:1",  # single values; 40 vectors
             # an fp32 norm weight beside bf16 rows (Megatron's without Float16Module)
             "bfloat16:128:64:1:1:0:1:float32", "bfloat16:128:64:1:1:1:1:float32",
             "bfloat16:512:64:1:0:0:1:float32", "bfloat16:512:64:1:0:1:1:float32",
             # kernels.rope_angles: THD positions, the angles of 32, 3 and 1 pairs, cos and sin
             "positions", "angles:32", "angles:3", "angles:1", "trig:32", "trig:1",
             "offsets:4", "offsets:128", "offsets:3",  # kernels.offsets
             "guard:4", "guard:128", "guard:3",  # kernels.offsets' guard
             # kernels.column_sum: lanes of the CTAs and the finishing sum
             "colsum:128:4:0", "colsum:512:4:0", "colsum:96:8:0", "colsum:64:1:0",
             "colsum:32:8:0", "colsum:128:4:1", "colsum:64:8:1",
             # kernels.prefill_tail: 16-byte copies, 8-byte ones, 2-byte ones
             "tail:bfloat16:1024:4", "tail:float32:512:128", "tail:float16:130:2",
             # kernels.decode_entries: ratio 128's rings, 16-byte and 8-byte copies
             "entries:bfloat16:512:128", "entries:float32:64:128", "entries:float16:132:32",
             # kernels.prefill_offsets: the smallest and largest capacities
             "poffsets:8:4", "poffsets:64:128", "poffsets:16:1",
             # kernels.grouped_offsets: int32 and int64 group ids
             "goffsets:4:int32", "goffsets:128:int64"]
    env = dict(os.environ, CUTE_DSL_ARCH=arch,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(HERE, "epilogue_compile_probe.py"), *specs],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    infos = [json.loads(line) for line in res.stdout.strip().splitlines()]
    assert [i["spec"] for i in infos] == specs
    for info in infos:
        assert info["regs"] and all(s == 0 for s in info["spills"] + info["stack"]), info
        # the row kernels and the column sum launch as programmatic dependents (use_pdl)
        if info["spec"].split(":")[0] not in ("positions", "angles", "trig", "offsets", "guard",
                                              "tail", "entries", "poffsets", "goffsets"):
            assert info["ptx"] and info["pdl_wait"] and info["pdl_wait_first"], info


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", [("fwd", "bfloat16", 4, 2, 512), ("bwd", "bfloat16", 4, 2, 128),
                                 ("bwd_large", "bfloat16", 4, 2, 128),
                                 ("fwd", "float16", 128, 1, 512), ("bwd", "bfloat16", 128, 1, 512)],
                         ids=lambda c: "-".join(map(str, c)))
def test_the_eager_numerics_compile_spill_free_with_their_roundings(arch, cfg):
    """numerics="eager" (kernels rounding the weights and products to the input dtype): the
    same design as the fp32 kernel (copies, staging, CTAs an SM), no spills or local memory,
    and the dtype roundings in the PTX (two a slot and element, one conversion each or one a
    pair) on top of the fp32 kernel's (its output stores')."""
    plain = probe(arch, cfg)
    if plain.get("absent"):
        assert cfg[0] == "bwd_large" and arch == "sm_100a", cfg
        return
    eager = probe(arch, (*cfg, 0, 0, "eager"))
    assert all(s == 0 for s in eager["spills"]) and eager["local"] == 0, eager
    assert all(s == 0 for s in eager["stack"]), eager
    for key in ("coop", "async_copies_by_bytes", "target_ctas", "smem_asked", "pdl_wait_first",
                "vec", "chunk_slots"):
        assert eager[key] == plain[key], (key, eager[key], plain[key])
    added = (eager["cvt_rn"] - plain["cvt_rn"]) + 2 * (eager["cvt_rn_x2"] - plain["cvt_rn_x2"])
    assert added >= 2 * eager["chunk_slots"] * eager["vec"], (eager, plain)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg,ep", [
    (("fwd", "bfloat16", 4, 2, 512), "64:1:0:float32"), (("bwd", "bfloat16", 4, 2, 512), "64:1:0:float32"),
    (("fwd", "bfloat16", 4, 2, 128), "64:1:1:float32"), (("bwd", "bfloat16", 4, 2, 128), "64:1:1:float32"),
    (("bwd_large", "bfloat16", 4, 2, 128), "64:0:1:bfloat16"), (("fwd", "bfloat16", 4, 2, 128), "0:1:1:bfloat16"),
    (("fwd", "bfloat16", 128, 1, 512), "64:0:0:float32"), (("bwd", "bfloat16", 128, 1, 512), "64:0:0:float32"),
    (("bwd", "bfloat16", 128, 2, 128), "64:1:1:float32")],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c)
def test_the_pooling_kernels_with_the_epilogue_compile(arch, cfg, ep):
    """kernels.pool_epilogue at the Compressor's geometries: the pooling's design as the
    plain kernel's (copies, staging, vectors), the programmatic wait before any memory
    access, no local memory or stack, the epilogue's row math in the PTX (its pinned
    products, the rotation's shuffles where it rotates), a CTA barrier between the two
    phases, and a one-wave grid that the registers hold."""
    plain = probe(arch, cfg)
    if plain.get("absent"):
        assert cfg[0] == "bwd_large" and arch == "sm_100a", cfg
        return
    fused = probe(arch, (*cfg, 0, 0, "fp32", ep))
    assert not fused.get("absent"), "no kernel with the epilogue for a production geometry"
    assert fused["local"] == 0 and all(s == 0 for s in fused["stack"]), fused
    assert fused["pdl_wait_first"], fused
    for key in ("coop", "async_copies_by_bytes", "vec", "chunk_slots"):
        assert fused[key] == plain[key], (key, fused[key], plain[key])
    assert fused["mul_rn"] > plain["mul_rn"], (fused["mul_rn"], plain["mul_rn"])
    assert fused["bar_sync"] > plain["bar_sync"], (fused["bar_sync"], plain["bar_sync"])
    if ep.split(":")[2] == "1":
        assert fused["shfl_bfly"] > plain["shfl_bfly"], fused
    assert fused["smem_asked"] >= fused["smem_used"], fused
    if not (cfg[0] == "fwd" and T.long_window(cfg[2] * cfg[3])):
        # The rows' scratch lies over the pooling's idle buffers: asking for more than the
        # plain kernel takes a larger carveout and leaves the pooling's loads less L1. The
        # long forward's scratch sits beside its flag, an allocation of its own.
        assert fused["smem_asked"] == plain["smem_asked"], (fused["smem_asked"], plain["smem_asked"])
    assert fused["grid_ctas"] * fused["threads"] * (-(-max(fused["regs"]) // 8) * 8) <= 65536, fused



DECODE_CONFIGS = [("decode", "bfloat16", 4, 2, 512), ("decode", "float32", 2, 1, 512),
                  ("decode", "float16", 8, 1, 64), ("decode", "bfloat16", 4, 2, 128, 0, 0, "eager"),
                  ("decode", "float32", 1, 1, 65)]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=["-".join(map(str, c)) for c in DECODE_CONFIGS])
def test_the_decode_step_compiles_spill_free_with_one_cta_a_row(arch, cfg):
    """pool_decode: no spills or stack (a 64-bit remainder or a pointer kept across the
    division's slow-path calls brought a stack frame), the PDL wait first, the two CTA
    barriers of the step (the repeated-slot flag, then the slot's state read), the
    forward's vectors, one thread a column chunk of the row, and no non-coherent loads (a
    thread reads back the ring entries it wrote)."""
    info = probe(arch, cfg)
    assert info["nc_loads"] == 0, info
    assert info["spills"] == [0] and info["stack"] == [0] and info["local"] == 0, info
    assert info["pdl_wait"] and info["pdl_wait_first"], info
    assert info["bar_sync"] == 2, info
    d = cfg[4]
    assert info["vec"] == T.forward_vector_elems(d, info["elem_bytes"], cfg[2] * cfg[3])
    assert info["threads"] == d // info["vec"]
    assert info["mul_rn"] > 0  # the products' pinned rounding, as the forward's
