"""The on-disk compile cache on the GPU: a process that loads its kernels from the cache
(the pooling's and the small ones beside it, through the Compressor module's step)
computes what the compiling process computed, bit for bit, and compiles nothing."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(__file__)
PROBE = """
import hashlib, json, time, torch
t0 = time.perf_counter()
from csa_compressor import compress_thd_fused
from compile_counter import count_compiles
compiled = count_compiles()
digest = hashlib.sha256()
for ratio, coff, d in ((4, 2, 128), (128, 1, 512)):
    gen = torch.Generator(device="cuda").manual_seed(ratio)
    T = 3000
    kv = torch.randn(T, coff * d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    score = torch.randn(T, coff * d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    ape = torch.randn(ratio, coff * d, device="cuda", generator=gen).requires_grad_()
    cu = torch.tensor([0, 1000, 1003, T], dtype=torch.int32, device="cuda")
    out = compress_thd_fused(kv, score, ape, cu, None, T // ratio, ratio=ratio, coff=coff)
    out.float().square().sum().backward()
    for t in (out, kv.grad, score.grad, ape.grad):
        digest.update(t.detach().float().cpu().numpy().tobytes())
# the small kernels beside the pooling: offsets, rotary positions and angles, epilogue rows
from csa_compressor import Compressor
torch.manual_seed(0)
m = Compressor(256, 128, 4, rotate=True, dtype=torch.bfloat16, device="cuda")
x = torch.randn(3000, 256, device="cuda").bfloat16().requires_grad_()
out, _ = m(x, torch.tensor([0, 1000, 1003, 3000], dtype=torch.int32, device="cuda"), max_seqlen=1997)
out.float().square().sum().backward()
for t in (out, x.grad, *(p.grad for p in m.parameters())):
    digest.update(t.detach().float().cpu().numpy().tobytes())
torch.cuda.synchronize()
print(json.dumps({"compiled": len(compiled), "digest": digest.hexdigest(),
                  "first_calls_s": time.perf_counter() - t0}))
"""


def _run(cache):
    env = dict(os.environ, CSA_COMPRESSOR_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), HERE,
                                           os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_loaded_kernels_compute_what_compiled_ones_did(tmp_path):
    cold = _run(tmp_path)
    warm = _run(tmp_path)
    print("first calls: cold", round(cold["first_calls_s"], 2), "s, warm", round(warm["first_calls_s"], 2), "s")
    assert cold["compiled"] > 0 and warm["compiled"] == 0
    assert warm["digest"] == cold["digest"]
