"""The bulk-copy ring of pool_fwd_ring.PoolForwardRing (candidate FWD_BULK_RING), replayed:
one row lane's warps run the kernel's program in a random interleaving against a model of
the mbarriers (an arrival count, a transaction count and a phase; try_wait.parity passes
once the phase of that parity has completed), with each bulk copy landing at a random later
moment. Every interleaving must finish (a wrong phase hangs the GPU instead of failing) and
every row must read its own window: never an older row's, never one overwritten early.
The stage and phase arithmetic is the kernel's own (ring_slot)."""

import random

import pytest

pytest.importorskip("cutlass")

from csa_compressor.kernels.pool_fwd_ring import ring_slot  # noqa: E402


class MBarrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, n=1, expect_tx=0):
        assert self.pending >= n, "more arrivals than the phase expects"
        self.tx += expect_tx
        self.pending -= n
        self._complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._complete()

    def passed(self, parity):
        return self.phase % 2 != parity


def run_row_lane(stages, rows, warps, seed, empty_rows=(), lag=1):
    """Replays one row lane of ``warps`` warps walking ``rows`` rows; rows in
    ``empty_rows`` compute nothing (their issue arms 0 bytes and copies nothing). ``lag``:
    the issuer waits for row i - lag's release before reusing its stage (the kernel: 1)."""
    rng = random.Random(seed)
    lanes = 32 * warps
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(lanes) for _ in range(stages)]
    stage_data = [None] * stages
    in_flight = []  # (stage, row, bytes) copies issued and not landed
    read = {w: [] for w in range(warps)}

    def issue(row):
        stage, _ = ring_slot(row, stages)
        nbytes = 0 if row in empty_rows else 2
        full[stage].arrive(1, expect_tx=nbytes)
        for _ in range(nbytes):  # score's and kv's copies, a byte each here
            in_flight.append((stage, row, 1))

    def program(w):
        # The kernel's order for one warp; yields a predicate while it must wait.
        if w == 0:
            for p in range(stages - 1):
                if p < rows:
                    issue(p)
        for i in range(rows):
            ahead = i + stages - 1
            if w == 0 and ahead < rows:
                sa, _ = ring_slot(ahead, stages)
                if i >= lag:
                    _, last = ring_slot(i - lag, stages)
                    yield lambda sa=sa, last=last: empty[sa].passed(last)
                issue(ahead)
            stage, phase = ring_slot(i, stages)
            yield lambda stage=stage, phase=phase: full[stage].passed(phase)
            if i not in empty_rows:
                read[w].append((i, stage_data[stage]))
            empty[stage].arrive(32)

    actors = {w: program(w) for w in range(warps)}
    waiting = {w: None for w in range(warps)}
    for _ in range(100000):
        runnable = [w for w in actors if waiting[w] is None or waiting[w]()]
        choices = runnable + (["copy"] if in_flight else [])
        if not choices:
            break
        pick = rng.choice(choices)
        if pick == "copy":
            stage, row, nbytes = in_flight.pop(rng.randrange(len(in_flight)))
            stage_data[stage] = row  # a copy landing overwrites the stage
            full[stage].complete_tx(nbytes)
            continue
        try:
            waiting[pick] = next(actors[pick])
        except StopIteration:
            del actors[pick]
            del waiting[pick]
    assert not actors, f"deadlock: warps {sorted(actors)} still waiting"
    assert not in_flight
    for w in range(warps):
        want = [i for i in range(rows) if i not in empty_rows]
        assert [(i, i) for i in want] == read[w], (w, read[w])


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("warps", [1, 2, 4])
def test_ring_finishes_and_every_row_reads_its_window(stages, rows, warps):
    for seed in range(40):
        run_row_lane(stages, rows, warps, seed)
        run_row_lane(stages, rows, warps, seed, empty_rows={0, rows - 1})


def test_replay_catches_a_wrong_phase():
    """The replay is not vacuous: with every phase parity off by one, rows read stages
    their copies have not reached (or the lane hangs), and it fails."""
    import csa_compressor.kernels.pool_fwd_ring as ring

    real = ring.ring_slot
    try:
        globals()["ring_slot"] = lambda step, stages: (step % stages, (step // stages + 1) % 2)
        with pytest.raises(AssertionError):
            for seed in range(40):
                run_row_lane(2, 6, 4, seed)
    finally:
        globals()["ring_slot"] = real


def test_replay_catches_an_early_release():
    """Waiting for the release of the stage's use before last (row i - 2) lets a copy
    overwrite a row some warp has not read yet: the replay fails."""
    with pytest.raises(AssertionError):
        for seed in range(200):
            run_row_lane(2, 8, 4, seed, lag=2)
