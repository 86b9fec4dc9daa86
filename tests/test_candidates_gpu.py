"""Kernel candidates behind a config flag (kernels/config.py) against the default kernels.

A candidate changes how a kernel schedules its work, never its op order, so everything it
writes must be bitwise what the default writes, on buffers pre-filled with NaN (every
element written) and on packs whose row walks cross many segments inside one CTA. Once a
candidate is measured and made the default, its case here goes with the old code path.
"""

import contextlib

import pytest
import torch

from csa_compressor import pool_backward, pool_forward
from csa_compressor.kernels import compile as cc
from csa_compressor.kernels import config
from packs import make_pack

pytestmark = pytest.mark.gpu

CANDIDATES = [dict(BWD_CACHED_WALK=1), dict(BWD_APE_REGS=1), dict(WARP_SEGMENT_SEARCH=1),
              dict(STATIC_SLOT_OFFSETS=1), dict(BF16_BIT_WIDEN=1),
              dict(BWD_CACHED_WALK=1, BWD_APE_REGS=1, WARP_SEGMENT_SEARCH=1,
                   STATIC_SLOT_OFFSETS=1, BF16_BIT_WIDEN=1)]


@contextlib.contextmanager
def overridden(**values):
    """Compile and run with these config constants; the compile cache is not keyed by
    them, so it is emptied on the way in and restored on the way out."""
    saved_cache = dict(cc._CACHE)
    saved = {k: getattr(config, k) for k in values}
    cc._CACHE.clear()
    try:
        for k, v in values.items():
            setattr(config, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
        cc._CACHE.clear()
        cc._CACHE.update(saved_cache)


def _run(kv, score, ape, cu, cuc, N, ratio, coff, g):
    d = kv.shape[1] // coff
    nan = float("nan")
    out = torch.full((N, d), nan, dtype=kv.dtype, device="cuda")
    pool_forward(kv, score, ape, cu, cuc, out, ratio=ratio, coff=coff)
    dkv, dsc, dape = torch.full_like(kv, nan), torch.full_like(score, nan), torch.full_like(ape, nan)
    pool_backward(kv, score, ape, cu, cuc, g, dkv, dsc, dape, ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    return out, dkv, dsc, dape


def _many_segments(seed, n=400, longest=60):
    """n segments of 0..longest tokens: row walks cross segments inside a CTA, and the
    segment searches need several rounds (2500: three of the warp search)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, longest + 1, (n,), generator=gen).tolist()


CASES = [  # (lens, head_dim, ratio, coff, dtype, extra rows: capacity padding or, < 0, a cut)
    ([37, 0, 3, 64, 129, 1, 8, 250], 128, 4, 2, torch.bfloat16, 3),
    ("many", 128, 4, 2, torch.bfloat16, 5),
    ("many", 512, 4, 2, torch.bfloat16, 0),
    ("many", 128, 4, 2, torch.bfloat16, -7),
    ("many", 65, 4, 1, torch.bfloat16, 2),
    ("many", 64, 8, 2, torch.float32, 1),
    ("many", 64, 3, 2, torch.float16, 0),
    ("many", 128, 1, 1, torch.bfloat16, 4),
    ([8192, 1000, 3], 512, 4, 2, torch.bfloat16, 0),
    ("many2500", 128, 4, 2, torch.bfloat16, 2),
    ("many", 512, 128, 1, torch.bfloat16, 3),  # ratio 128: the slot-parallel kernels
]


@pytest.mark.parametrize("candidate", CANDIDATES, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_candidate_is_bitwise_the_default(candidate, case):
    lens, d, ratio, coff, dtype, extra = CASES[case]
    if lens == "many":
        lens = _many_segments(case, longest=60 if ratio <= 8 else 400)
    elif lens == "many2500":
        lens = _many_segments(case, n=2500, longest=12)
    kv, score, ape, cu, cuc, N = make_pack(lens, d, ratio, coff, dtype=dtype, device="cuda",
                                           pad_tokens=5, extra_rows=max(extra, 0), seed=case)
    N = max(0, N + min(extra, 0))
    g = torch.randn(N, d, device="cuda").to(dtype)
    default = _run(kv, score, ape, cu, cuc, N, ratio, coff, g)
    with overridden(**candidate):
        cand = _run(kv, score, ape, cu, cuc, N, ratio, coff, g)
    for name, a, b in zip(("out", "dkv", "dscore", "dape"), default, cand):
        assert not torch.isnan(b).any(), f"{name}: elements left unwritten"
        assert torch.equal(a, b), f"{name}: differs from the default kernels"
