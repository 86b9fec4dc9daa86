"""The opt-in on-disk compile cache (CSA_COMPRESSOR_CACHE_DIR): a second process loads
what the first compiled, for sm_90a on a CPU machine (compile-only; the GPU run is
tests/test_disk_cache_gpu.py)."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

HERE = os.path.dirname(__file__)
PROBE = """
import json, sys, torch
from csa_compressor.kernels import compile as cc
from compile_counter import count_compiles
compiled = count_compiles()
b = cc.get_kernel("bwd", torch.device("cpu"), torch.bfloat16, 4, 2, 128)
f = cc.get_kernel("fwd", torch.device("cpu"), torch.bfloat16, 4, 2, 128)
print(json.dumps({"compiled": len(compiled), "regs": [b.registers, f.registers],
                  "ctas": [b.ctas_per_sm, f.ctas_per_sm], "dape": b.dape is not None}))
"""


def _run(cache, config=""):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CSA_CONFIG=config,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), HERE,
                                           os.environ.get("PYTHONPATH", "")]))
    if cache is None:
        env.pop("CSA_COMPRESSOR_CACHE_DIR", None)
    else:
        env["CSA_COMPRESSOR_CACHE_DIR"] = str(cache)
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def _entries(cache):
    names = sorted(os.listdir(cache))
    return [n for n in names if n.endswith(".so")], [n for n in names if n.endswith(".json")], names


@pytest.mark.compile
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    cold, _ = _run(cache)
    libs, records, names = _entries(cache)
    # bwd, its dape sum, its large-pack variant, fwd: each an entry, nothing half-written
    assert cold["compiled"] == 4 and len(libs) == len(records) == 4 and len(names) == 8, names
    # each library exports its own function name: the DSL loads them into one global symbol
    # scope, where a shared name would make every lookup find the first library's kernel
    from csa_compressor.kernels import disk_cache

    for lib in libs:
        exported = set(re.findall(rb"__tvm_ffi_(csa_\w+)", (cache / lib).read_bytes()))
        assert exported == {disk_cache.symbol(lib[:-3]).encode()}, (lib, exported)
    warm, _ = _run(cache)
    assert warm["compiled"] == 0, warm
    assert (warm["regs"], warm["ctas"], warm["dape"]) == (cold["regs"], cold["ctas"], True)
    assert _entries(cache)[2] == names  # a hit writes nothing
    # another tuning is another entry: the forward compiles again, the backward's family too
    variant, _ = _run(cache, "FWD_STAGES=3")
    assert variant["compiled"] >= 1 and len(_entries(cache)[0]) > 4


@pytest.mark.compile
def test_a_damaged_entry_compiles_again_with_a_warning(tmp_path):
    cache = tmp_path / "cache"
    _run(cache)
    libs, _, _ = _entries(cache)
    for name in libs:
        with open(cache / name, "wb") as f:
            f.write(b"not a library")
    again, err = _run(cache)
    assert again["compiled"] == 4 and "could not load an entry" in err


def test_the_cache_is_off_without_its_variable(tmp_path, monkeypatch):
    from csa_compressor.kernels import disk_cache

    monkeypatch.delenv(disk_cache.ENV, raising=False)
    assert disk_cache.directory() is None
    assert disk_cache.load(None, "sm_90a") is None
    disk_cache.store(None, "sm_90a", None, 64)  # a no-op: nothing to write to
    monkeypatch.setenv(disk_cache.ENV, "")
    assert disk_cache.directory() is None


def test_a_failing_store_never_fails_the_call(tmp_path, monkeypatch, caplog):
    from csa_compressor.kernels import disk_cache, plan

    monkeypatch.setenv(disk_cache.ENV, str(tmp_path / "cache"))

    class NoExport:
        def export_to_c(self, *a, **k):
            raise RuntimeError("no export here")

    spec = plan.spec("fwd", __import__("torch").bfloat16, 4, 2, 128)
    disk_cache._warned.clear()
    with caplog.at_level("WARNING", logger="csa_compressor.cache"):
        disk_cache.store(spec, "sm_90a", NoExport(), 64)
    assert "could not store an entry" in caplog.text
    assert os.listdir(tmp_path / "cache") == []  # the temporary entry is gone too


SMALL_PROBE = """
import json
from csa_compressor.kernels import offsets, rope_angles
from csa_compressor.kernels.jit import SmallSpec, compile_small
from compile_counter import count_compiles
compiled = count_compiles()
for ratio in (4, 128):
    compile_small(SmallSpec("offsets", ratio=ratio),
                  lambda r=ratio: (offsets.CompressedOffsets(r), offsets.compile_args()))
compile_small(SmallSpec("rope_angles", head_dim=32),
              lambda: (rope_angles.RopeAngles(32), rope_angles.compile_args("angles", 32)))
print(json.dumps({"compiled": len(compiled)}))
"""


@pytest.mark.compile
def test_the_small_kernels_are_kept_too(tmp_path):
    """The small kernels beside the pooling (compile.compile_small) take the same cache: one
    entry a specialisation (the offsets' ratio, the angles' width), loaded by the next
    process instead of compiled."""
    cache = tmp_path / "cache"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CSA_COMPRESSOR_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), HERE,
                                           os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", SMALL_PROBE], env=env, capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1])["compiled"])
    assert runs == [3, 0], runs
    assert len(_entries(cache)[0]) == 3


def test_small_kernel_entries_are_named_by_everything_that_specialises_them():
    """small_kernel names a kernel's entry by its whole key: keys that differ in any value
    (a ratio, a width, a dtype, an eps, a flag) or in the target name different entries."""
    import torch

    from csa_compressor.kernels import disk_cache
    from csa_compressor.kernels.jit import small_spec

    keys = [("offsets", 4), ("offsets", 128), ("rope", "angles", 32), ("rope", "angles", 16),
            ("rope", "positions", 0), ("column_sum", 128, 4, True), ("column_sum", 128, 4, False)]
    rows = ("epilogue_rows", torch.bfloat16, torch.bfloat16, 128, 64, True, False, False, True,
            1e-06)
    keys += [rows, rows[:-1] + (1e-05,), rows[:1] + (torch.float16,) + rows[2:],
             rows[:2] + (torch.float32,) + rows[3:], rows[:7] + (True,) + rows[8:]]
    names = [disk_cache.entry_name(small_spec(k), "sm_90a") for k in keys]
    assert len(set(names)) == len(names)
    assert disk_cache.entry_name(small_spec(("offsets", 4)), "sm_100a") != names[0]
    assert disk_cache.entry_name(small_spec(("offsets", 4)), "sm_90a") == names[0]


def test_a_small_kernel_not_compiled_while_a_graph_captures_is_none(monkeypatch):
    """jit.small_kernel: compiled once a (device, key) and kept, its entry named by the
    key; while a CUDA graph captures, a kernel not compiled yet is None (its
    caller runs the torch ops, the same bits) and nothing is compiled."""
    import torch

    from csa_compressor.kernels import jit as cc

    built = []
    monkeypatch.setattr(cc, "_SMALL", {})
    monkeypatch.setattr(cc, "compile_small", lambda spec, build: (built.append((spec, build)) or
                                                                  (f"fn {spec.direction}", None)))
    dev = torch.device("cuda", 0)

    def build():
        raise AssertionError("small_kernel leaves the build to compile_small")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cc.small_kernel(("offsets", 4), dev, build) is None and built == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert cc.small_kernel(("offsets", 4), dev, build) == "fn offsets 4"
    assert built == [(cc.small_spec(("offsets", 4)), build)]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cc.small_kernel(("offsets", 4), dev, build) == "fn offsets 4"  # kept
    assert len(built) == 1
    assert cc.small_kernel(("offsets", 128), dev, build) is None
    assert cc.small_kernel(("offsets", 4), torch.device("cuda", 1), build) is None
    assert len(built) == 1


def test_a_kernel_with_the_epilogue_inside_has_its_own_entry():
    """The spec's epilogue is part of the entry's name: the pooling kernel with the
    epilogue inside takes more arguments than the plain one, and loading one for the other
    failed every call with a warm cache (seen on the H200)."""
    import torch

    from csa_compressor.epilogue import Epilogue
    from csa_compressor.kernels import disk_cache, plan

    key = plan.EpilogueKey.of(Epilogue(rope_dim=64), torch.float32)
    plain = plan.spec("fwd", torch.bfloat16, 4, 2, 128)
    inside = plan.spec("fwd", torch.bfloat16, 4, 2, 128, epilogue=key)
    other = plan.spec("fwd", torch.bfloat16, 4, 2, 128,
                      epilogue=plan.EpilogueKey.of(Epilogue(rope_dim=32), torch.float32))
    names = {disk_cache.entry_name(s, "sm_90a") for s in (plain, inside, other)}
    assert len(names) == 3
