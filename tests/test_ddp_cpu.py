"""The DDP example on two CPU processes (gloo): what the CPUs allow of the two-GPU check."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("ratio", [4, 128])
def test_ddp_step_matches_one_process(ratio):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(HERE, "..", "examples", "ddp_compressor.py"),
         "--device", "cpu", "--ratio", str(ratio)],
        env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "PASS: world 2, gloo" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs two GPUs")
def test_ddp_step_two_gpus():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(HERE, "..", "examples", "ddp_compressor.py"), "--device", "cuda"],
        env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "PASS: world 2, nccl" in res.stdout
