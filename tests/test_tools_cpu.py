"""Every tool in tools/ answers --help with its description, and a tool that needs a GPU
says so and exits 2 on a machine without one."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
NAMES = sorted(f for f in os.listdir(TOOLS) if f.endswith(".py") and not f.startswith("_"))
CPU_TOOLS = {"ptx_snapshot.py", "sass_probe.py", "spill_survey.py", "compile_time_probe.py",
             "host_python_probe.py"}


def test_every_tool_answers_help():
    def ask(name):
        return name, subprocess.run([sys.executable, os.path.join(TOOLS, name), "--help"],
                                    capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=4) as pool:  # a process each: startup-bound
        for name, res in pool.map(ask, NAMES):
            assert res.returncode == 0, (name, res.stderr[-2000:])
            assert len(res.stdout.strip()) > 40, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
@pytest.mark.parametrize("name", sorted(set(NAMES) - CPU_TOOLS)[:1])
def test_a_gpu_tool_says_it_needs_one_and_exits_2(name):
    res = subprocess.run([sys.executable, os.path.join(TOOLS, name)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, (res.returncode, res.stderr)


def test_the_host_python_probe_runs_without_a_gpu():
    """The launches-stubbed probe of the op layer's Python share runs anywhere (CPU tensors,
    the kernels' designs built, nothing compiled) and reports each row, the floor of the
    step's design among them."""
    res = subprocess.run([sys.executable, os.path.join(TOOLS, "host_python_probe.py"), "20"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count(" µs  ") == 10 and "Python share" in res.stdout, res.stdout
    assert "above the floor of its design" in res.stdout, res.stdout
    # the empty-slot prefill launches its offsets kernel, the pooling and the tail, nothing
    # else (its offsets are no copy: kernels/prefill_offsets)
    assert "streaming prefill into 8 empty slots (3 launches)" in res.stdout, res.stdout
