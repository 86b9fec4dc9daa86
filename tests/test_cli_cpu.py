"""The command line on a machine without a GPU (CI): info says what it finds and exits 0;
bench and check say they ran nothing and exit 2; bad arguments exit 2 before anything
heavy loads; report renders results.md from a results.json."""

import json
import os

import pytest
import torch

from csa_compressor import shapes
from csa_compressor.cli import bench
from csa_compressor.cli import main as cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("argv,code,expect", [
    (["info"], 0, "eager fallback (tensors are on cpu"),
    (["bench"], 2, "nothing was run"), (["check"], 2, "nothing was run"),
    (["bench", "--same-inputs"], 2, "nothing was run"),
    (["bench", "--out", "somewhere"], 2, "nothing was run"),
])
def test_no_gpu_commands(argv, code, expect, capsys):
    assert cli.main(argv) == code
    out = capsys.readouterr()
    assert expect in out.out + out.err


@pytest.mark.parametrize("argv,expect", [
    (["bench", "--impls", "eager,fuzed"], "--impls"),
    (["bench", "--shapes", "3x8192:512"], "--shapes"),
    (["bench", "--shapes", "3x8192:512:4:3"], "--shapes"),
    (["bench", "--shapes", ","], "--shapes"),
    (["bench", "--dtype", "fp64"], "--dtype"),
    (["bench", "--outt", "x"], "unrecognized"),
    (["check", "--dtypes", "bf16,int8"], "--dtypes"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_the_argument_named(argv, expect, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert expect in capsys.readouterr().err


def test_help_answers_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys, csa_compressor.cli.main as m\n"
            "try:\n    m.main(['bench', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--shapes" in res.stdout


def test_shape_parsing():
    s = shapes.parse_shape("1023+2048+0:128:4:2")
    assert s.lens == (1023, 2048, 0) and (s.d, s.ratio, s.coff) == (128, 4, 2)
    assert shapes.parse_shape("3x8192:512:128:1").name == "3x8192:512:128:1"
    with pytest.raises(ValueError, match="--shapes"):
        shapes.parse_shape("3x8192:512")
    assert len(shapes.shapes_from_arg("default")) == 9


def test_report_renders_results(tmp_path):
    result = {"environment": {"gpu": "X", "driver": "1", "torch": "t", "cutlass_dsl": "4.8.1",
                              "commit": "abc", "date": "d"},
              "copy_bandwidth_tbps": 4.0, "dtype": "torch.bfloat16", "calls_per_graph": 20,
              "rows": [{"shape": "1x8192:128:4:2", "impl": "fused", "fwd_us": 7.0, "fwdbwd_us": 28.0,
                        "floor_fwd_us": 2.0, "floor_fwdbwd_us": 6.0, "fwd_pct_floor": 28.6,
                        "fwdbwd_pct_floor": 21.4, "fwd_tbps": 1.2, "fwdbwd_tbps": 0.9,
                        "wall_fwd_us": 50.0, "peak_mib": 10.0},
                       {"shape": "1x8192:128:4:2", "impl": "eager", "error": "boom"}]}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(result))
    assert cli.main(["report", str(src), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "commit abc" in md and "| 1x8192:128:4:2 | fused | 7.0 | 28.0 |" in md and "error: boom" in md


def test_header_names_the_input_method():
    """Which inputs the 20 calls of a graph read is part of the method (docs/lab/ceilings.md
    v25: L2-warm and rotating figures differ by up to 2x at the small packs)."""
    result = {"environment": {"gpu": "X", "driver": "1", "torch": "t", "cutlass_dsl": "4.8.1",
                              "commit": "abc", "date": "d"},
              "copy_bandwidth_tbps": 4.0, "dtype": "torch.bfloat16", "calls_per_graph": 20}
    assert "rotating over inputs of twice the L2" in bench.header(result)
    assert "same inputs (L2-warm" in bench.header({**result, "same_inputs": True})


def test_input_sets_cover_twice_the_l2():
    """The bench and the probes rotate over as many input copies as exceed twice the L2,
    at most one a call of the graph."""
    l2 = 50 << 20
    assert bench.input_sets(9 << 20, l2) == 12  # ceil(100 / 9)
    assert bench.input_sets(107 << 20, l2) == 1
    assert bench.input_sets(1, l2) == bench.CALLS_PER_GRAPH
    assert bench.input_sets(0, l2) == bench.CALLS_PER_GRAPH


def test_source_commit_is_the_packages_checkout(tmp_path, monkeypatch):
    """The bench labels its figures with the commit of the checkout the package runs from,
    wherever it is run from (a user's training repository is not ours)."""
    import shutil
    import subprocess

    pkg = os.path.dirname(os.path.abspath(bench.__file__))
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    try:
        top = subprocess.check_output(["git", "-C", pkg, "rev-parse", "--show-toplevel"],
                                      text=True, stderr=subprocess.DEVNULL).strip()
    except subprocess.CalledProcessError:
        pytest.skip("the package is not in a git checkout")
    if not os.path.samefile(os.path.join(top, "src", "csa_compressor", "cli", "bench.py"), bench.__file__):
        pytest.skip("the package is installed, not run from its checkout")
    head = subprocess.check_output(["git", "-C", top, "rev-parse", "--short", "HEAD"],
                                   text=True).strip()
    other = tmp_path / "elsewhere"
    other.mkdir()
    subprocess.check_call(["git", "init", "-q", str(other)])
    monkeypatch.chdir(other)
    monkeypatch.delenv("CSA_COMMIT", raising=False)
    commit = bench.source_commit()
    assert commit in (head, head + "-dirty"), commit
    assert bench.environment()["commit"] == commit
    monkeypatch.setenv("CSA_COMMIT", "abc1234")
    assert bench.environment()["commit"] == "abc1234"


def test_the_gate_checks_the_epilogue_node_against_its_composition(monkeypatch):
    """check.run_epilogue: on the CPU the node runs the composition's torch ops, so every
    row holds; a node whose output is off in one row is reported and counted."""
    import torch

    from csa_compressor import epilogue, epilogue_op
    from csa_compressor.cli import check

    lines = []
    grid, rows = [(128, 64, True, True), (64, 0, True, False)], (37,)
    assert check.run_epilogue(torch.device("cpu"), ("bf16", "fp32"), lines.append, grid, rows) == 0
    table = [line for line in lines if line.startswith("| 1") or line.startswith("| 6")]
    assert len(table) == 2 * 2 * 3 and all(line.endswith("| ok |") for line in table)

    real = epilogue_op.apply_epilogue

    def perturbed(*a, **k):
        y = real(*a, **k)
        return y + torch.zeros_like(y).index_fill_(0, torch.tensor([3]), 1e-2 * y.abs().max().item())

    monkeypatch.setattr(epilogue_op, "apply_epilogue", perturbed)
    lines.clear()
    failed = check.run_epilogue(torch.device("cpu"), ("fp32",), lines.append, grid[:1], rows)
    assert failed == 1  # the output only: the gradients of y + c are the node's
    assert sum("FAIL" in line for line in lines) == 1 and any("| out |" in line and "FAIL" in line
                                                              for line in lines)


def test_the_gate_checks_the_eager_numerics_against_the_upstream_region(monkeypatch):
    """check.run_eager: with the op standing in as the reference of the numerics it is
    handed (the kernels' contract), every clause holds; an op that ignores numerics="eager"
    (the fp32 pooling) fails the bf16 clauses."""
    import torch

    from csa_compressor import ops, reference
    from csa_compressor.cli import check

    def standin(honour):
        def op(*a, numerics="fp32", **k):
            mode = "upstream" if honour and numerics == "eager" else "fp32"
            return reference.compress_thd(*a, mode=mode, **k)
        return op

    grid = ["37+0+3+64:32:4:2"]
    lines = []
    monkeypatch.setattr(ops, "compress_thd_fused", standin(True))
    assert check.run_eager(grid, ("bf16", "fp32"), lines.append, torch.device("cpu")) == 0
    assert sum(line.endswith("| ok |") for line in lines) == 2 * 4
    monkeypatch.setattr(ops, "compress_thd_fused", standin(False))
    lines.clear()
    assert check.run_eager(grid, ("bf16",), lines.append, torch.device("cpu")) > 0
    assert any("| dkv |" in line and "upstream region (bitwise owed)" in line for line in lines)


def test_the_gate_checks_the_pooling_with_the_epilogue_against_its_composition(monkeypatch):
    """check.run_pool_epilogue: with a CPU stand-in for the op (the reference pooling, then
    the epilogue node, which on the CPU runs the composition's torch ops) every output of
    every kernel choice holds; an op whose output is off in one row fails the output of each
    choice, and only it."""
    import torch

    from csa_compressor import epilogue as E, epilogue_op as EO, ops, reference
    from csa_compressor.cli import check

    def standin(shift):
        def op(kv, score, ape, cu, cuc, n, *, ratio, coff, epilogue=None, norm_weight=None,
               positions=None, epilogue_inside=None):
            pooled = reference.compress_thd(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                            mode="fp32")
            if epilogue is None:
                return pooled
            y = EO.apply_epilogue(pooled, norm_weight, positions, epilogue)
            return y + torch.zeros_like(y).index_fill_(0, torch.tensor([1]), shift)
        return op

    grid = [("37+0+3+64:64:4:2", 32, True, True), ("37+0+90:64:32:1", 0, True, False)]
    lines = []
    monkeypatch.setattr(ops, "compress_thd_fused", standin(0.0))
    assert check.run_pool_epilogue(torch.device("cpu"), ("bf16", "fp32"), lines.append, grid) == 0
    table = [line for line in lines if line.startswith("| 37")]
    assert len(table) == 2 * 2 * len(check.KERNEL_CHOICES) * 5
    assert all(line.endswith("| ok |") for line in table)
    monkeypatch.setattr(ops, "compress_thd_fused", standin(0.5))
    lines.clear()
    failed = check.run_pool_epilogue(torch.device("cpu"), ("fp32",), lines.append, grid[:1])
    assert failed == len(check.KERNEL_CHOICES)  # the output only: y + c has y's gradients
    assert all("| out |" in line for line in lines if "FAIL" in line)


@pytest.mark.parametrize("content", [None, "{bad", '{"a": 1}'])
def test_report_refuses_a_file_it_cannot_read_in_one_line_and_writes_nothing(tmp_path, capsys,
                                                                            content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    assert cli.main(["report", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("csa-compressor report: cannot read") and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["info", "bench", "check", "report"])
def test_every_subcommand_describes_itself(capsys, cmd):
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: csa-compressor {cmd}") and len(text.split("\n\n")[1]) > 40
