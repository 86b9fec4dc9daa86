"""The backward's zero-fill walk (backward_grid.BackwardGrid.zero_tokens) and where it starts
(first_unread: the tokens before the segment's first unread block are skipped, all of
them where every token is read) replayed in Python: the tokens it skips are ones the walk
would have stored nothing for, for valid packs (short, empty and tail segments, tokens
past cu_seqlens[B], rows cut off by total_comp) and corrupt offsets alike; and on a pack
of full sequences almost every thread skips all its tokens."""

import random

import pytest

from test_segment_search_cpu import find_segment

INT32_MAX = 2**31 - 1


def span(cu, cuc, s, ratio):
    """BackwardGrid.segment_span."""
    B = len(cu) - 1
    if s < B:
        return cu[s], cu[s + 1], (cu[s + 1] - cu[s]) // ratio, cuc[s]
    return 0, INT32_MAX, 0, 0


def advance(cu, s, x):
    """segments.advance_segment."""
    B = len(cu) - 1
    while s < B and cu[min(s + 1, B)] <= x:
        s += 1
    return s


def first_unread(cu, cuc, t0, Z, ratio, coff, num_rows, T):
    """BackwardGrid.first_unread after zero_unread's one search."""
    s = find_segment(cu, min(t0, T))
    start, end, nb, rowb = span(cu, cuc, s, ratio)
    k = min(nb, num_rows - rowb) - (1 if coff == 2 else 0)
    if start >= 0 and end >= start and t0 >= start and k > 0:
        assert start + k * ratio <= end <= INT32_MAX  # no int32 overflow in the kernel
        return min(max(start + k * ratio - t0, 0), Z)
    return 0


def walk_stores(cu, cuc, t0, Z, ratio, coff, num_rows, T, j0=0):
    """zero_tokens from t0 + j0: the (token, half) pairs it zeroes ("own" columns, "prev"
    columns)."""
    s = find_segment(cu, min(t0, T))
    start, end, nb, rowb = span(cu, cuc, s, ratio)
    stores = set()
    for t in range(t0 + j0, t0 + Z):
        if t < T:
            if t >= end:
                s = advance(cu, s, t)
                start, end, nb, rowb = span(cu, cuc, s, ratio)
            blk = (t - start) // ratio
            row = rowb + blk
            if not (blk < nb and row < num_rows):
                stores.add((t, "own"))
            if coff == 2 and not (blk + 1 < nb and row + 1 < num_rows):
                stores.add((t, "prev"))
    return stores


def _valid_pack(rng, ratio):
    lens = [rng.choice([0, 1, ratio - 1, ratio, ratio + 1, 2 * ratio + 3, rng.randrange(200)])
            for _ in range(rng.randrange(1, 8))]
    cu, cuc = [0], [0]
    for n in lens:
        cu.append(cu[-1] + n)
        cuc.append(cuc[-1] + n // ratio)
    T = cu[-1] + rng.choice([0, 0, 3, 40])  # tokens past cu_seqlens[B]
    N = max(0, cuc[-1] - rng.choice([0, 0, 1, 5]))  # rows cut off by total_comp
    return cu, cuc, T, N


@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8, 128])
def test_skipped_threads_would_store_nothing(ratio, coff):
    rng = random.Random(1000 * ratio + coff)
    for trial in range(150):
        if trial % 5 == 4:  # corrupt offsets: anything at all
            B = rng.randrange(1, 6)
            cu = [rng.randrange(-20, 300) for _ in range(B + 1)]
            cuc = [rng.randrange(-20, 80) for _ in range(B + 1)]
            T, N = rng.randrange(0, 300), rng.randrange(0, 80)
        else:
            cu, cuc, T, N = _valid_pack(rng, ratio)
        for Z in (1, 4, 7, 32):
            for t0 in sorted({*range(0, T + Z, Z), *(rng.randrange(T + 5) for _ in range(5))}):
                # The tokens first_unread skips are ones the walk would store nothing for.
                j0 = first_unread(cu, cuc, t0, Z, ratio, coff, N, T)
                assert 0 <= j0 <= Z
                if j0 == Z:
                    assert not walk_stores(cu, cuc, t0, Z, ratio, coff, N, T), (cu, cuc, T, N, t0, Z)
                assert (walk_stores(cu, cuc, t0, Z, ratio, coff, N, T, j0)
                        == walk_stores(cu, cuc, t0, Z, ratio, coff, N, T)), (cu, cuc, T, N, t0, Z, j0)


@pytest.mark.parametrize("coff", [1, 2])
def test_full_sequences_skip_almost_every_thread(coff):
    """3x8192, ratio 4, 32 tokens a thread: only the threads at a segment's last block
    (coff 2: its first d columns are nobody's previous block) still walk."""
    ratio, Z = 4, 32
    cu = [0, 8192, 16384, 24576]
    cuc = [0, 2048, 4096, 6144]
    T, N = 24576, 6144
    starts = range(0, T, Z)
    walked = [t0 for t0 in starts if first_unread(cu, cuc, t0, Z, ratio, coff, N, T) < Z]
    assert len(walked) == (3 if coff == 2 else 0), walked
    for t0 in walked:
        assert walk_stores(cu, cuc, t0, Z, ratio, coff, N, T)


@pytest.mark.parametrize("coff", [1, 2])
def test_many_short_sequences_walk_only_their_tail(coff):
    """2048x64, ratio 4, 32 tokens a thread: with coff 2 every segment's second thread walks
    (its last block's first d columns are nobody's previous block); first_unread starts it
    at that block, 4 tokens from its end (docs/lab/tuning-long.md: fwd+bwd 144.0-145.0 -> 134.5 us on that pack)."""
    ratio, Z, B = 4, 32, 2048
    cu = [64 * s for s in range(B + 1)]
    cuc = [16 * s for s in range(B + 1)]
    T, N = cu[-1], cuc[-1]
    walked = [t0 for t0 in range(0, T, Z) if first_unread(cu, cuc, t0, Z, ratio, coff, N, T) < Z]
    assert len(walked) == (B if coff == 2 else 0)
    for t0 in walked:
        assert first_unread(cu, cuc, t0, Z, ratio, coff, N, T) == Z - ratio
