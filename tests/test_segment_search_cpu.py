"""segments.find_segment_warp replayed in Python, lane by lane: the 32-ary warp search must
give find_segment's answer (the upper bound) on non-decreasing offsets, with at most
ceil(log32(B)) + 1 rounds of dependent loads, and stay in [0, B] and terminate on any
offsets (a caller error must never turn into an out-of-bounds read or a hang)."""

import bisect
import math
import random

import pytest


def find_segment(cu, x):
    """segments.find_segment: largest s in [0, B] with cu[s] <= x (binary search)."""
    lo, n = 0, len(cu) - 1
    while n > 0:
        half = n // 2
        if cu[lo + half + 1] <= x:
            lo, n = lo + half + 1, n - half - 1
        else:
            n = half
    return lo


def find_segment_warp(cu, x):
    """segments.find_segment_warp, the 32 lanes simulated; returns (answer, rounds, reads)."""
    lo, hi = 0, len(cu) - 1
    rounds, reads = 0, set()
    while hi > lo:
        step = (hi - lo + 31) // 32
        ballot = []
        for lane in range(32):
            p = lo + 1 + lane * step
            q = min(p, hi)
            assert 1 <= q < len(cu)  # every load stays inside the offsets
            reads.add(q)
            ballot.append(p <= hi and cu[q] <= x)
        k = sum(ballot)
        new_lo = lo + 1 + (k - 1) * step if k > 0 else lo
        hi = min(hi, lo + k * step)
        lo = new_lo
        rounds += 1
        assert rounds <= 64, "no termination"
    return lo, rounds, reads


def _packs(rng):
    for B in (1, 2, 5, 6, 31, 32, 33, 63, 64, 65, 1000, 1023, 1024, 1025, 2048, 40000):
        lens = [rng.choice([0, 0, 1, 3, 64, rng.randrange(200)]) for _ in range(B)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        yield cu


@pytest.mark.parametrize("seed", range(3))
def test_matches_binary_search_on_offsets(seed):
    rng = random.Random(seed)
    for cu in _packs(rng):
        B = len(cu) - 1
        xs = {0, cu[-1], cu[-1] + 5, max(0, cu[-1] - 1)} | {rng.randrange(cu[-1] + 2) for _ in range(200)}
        xs |= set(cu)
        for x in xs:
            want = find_segment(cu, x)
            assert want == bisect.bisect_right(cu, x) - 1 if x >= 0 else True
            got, rounds, _ = find_segment_warp(cu, x)
            assert got == want, (B, x)
            assert rounds <= math.ceil(math.log(B, 32)) + 1 if B > 1 else rounds <= 1


@pytest.mark.parametrize("seed", range(5))
def test_any_offsets_stay_in_range_and_terminate(seed):
    rng = random.Random(100 + seed)
    for B in (1, 3, 32, 33, 500, 3000):
        cu = [rng.randrange(-50, 5000) for _ in range(B + 1)]
        for x in [rng.randrange(-10, 6000) for _ in range(50)]:
            got, _, _ = find_segment_warp(cu, x)
            assert 0 <= got <= B
