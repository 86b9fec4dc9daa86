"""The DDP example on two CPU processes (gloo): what the CPUs allow of the two-GPU check."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def _run_ranks(args, env, world, timeout, tmp_path):
    """Start the example's ranks as plain processes that meet through a file store.

    torchrun's elastic agent and its TCP rendezvous are one more thing that can stall on a
    loaded CI machine; the example itself is what is under test. Every rank gets its own
    deadline and is killed on expiry, so a stall fails the test instead of hanging it."""
    store = tmp_path / "store"
    procs = []
    for rank in range(world):
        renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "..", "examples", "ddp_compressor.py"),
             "--init-method", f"file://{store}", *args],
            env=renv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            pytest.fail(f"rank timed out after {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
        outs.append((p.returncode, out, err))
    return outs


@pytest.mark.parametrize("ratio", [4, 128])
def test_ddp_step_matches_one_process(ratio, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    # Without a GPU the example picks the CPU by itself: ratio 4 runs on its defaults.
    gpu = __import__("torch").cuda.is_available()
    device = ["--device", "cpu"] if ratio != 4 or gpu else []
    outs = _run_ranks([*device, "--ratio", str(ratio)], env, world=2, timeout=300,
                      tmp_path=tmp_path)
    for rc, out, err in outs:
        assert rc == 0, out[-2000:] + err[-3000:]
    assert "PASS: world 2, gloo" in outs[0][1]


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
