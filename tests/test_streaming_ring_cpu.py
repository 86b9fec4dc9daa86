"""decode's one-launch path (pooling="ring") on the CPU: the glue around the kernel, with
tests/kernel_standin.DecodeStandin (the kernel's contract) standing in for it, gives the
training rows, with and without the epilogue, eager and under the capture branch; where
the kernel cannot take a call, "ring" is the gather path."""

import types

import pytest
import torch

from csa_compressor import Epilogue, streaming
from csa_compressor.kernels import plan, tuning
from csa_compressor.streaming import ring
from kernel_standin import DecodeStandin, PrefillTailStandin
from stream_driver import Stream, random_lens


@pytest.fixture
def standin(monkeypatch):
    """ring.launcher answers with the stand-in wherever the kernel would run."""
    made = []

    def launcher(state, kv, score, ape, settings):
        k = DecodeStandin(state.ratio, state.coff, settings.numerics)
        made.append(k)
        return types.SimpleNamespace(fn=k.fn)

    monkeypatch.setattr(ring, "launcher", launcher)
    return made


@pytest.fixture
def tail_standin(monkeypatch):
    """ring.tail_launcher answers with the prefill tail's stand-in."""
    made = []

    def tail_launcher(state, kv, score):
        k = PrefillTailStandin(state.ratio)
        made.append(k)
        return k.fn

    monkeypatch.setattr(ring, "tail_launcher", tail_launcher)
    return made


def _lens(ratio, k, seed):
    return random_lens(ratio, k, seed, 3 * ratio + 20)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (1, 1), (2, 1), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numerics", ["fp32", "eager"])
def test_ring_steps_give_the_training_rows(standin, ratio, coff, dtype, numerics):
    st = streaming.StreamState(3, 64, ratio=ratio, coff=coff, dtype=dtype)
    run = Stream(st, _lens(ratio, 5, ratio), seed=ratio + coff, numerics=numerics,
                 pooling="ring", max_n=4)
    run.run()
    run.check()
    assert standin and sum(k.calls for k in standin) > 0


@pytest.mark.parametrize("ratio,coff", [(4, 2), (2, 1)])
@pytest.mark.parametrize("rotate", [False, True])
def test_ring_steps_with_the_epilogue_give_the_training_rows(standin, ratio, coff, rotate):
    st = streaming.StreamState(3, 64, ratio=ratio, coff=coff)
    run = Stream(st, _lens(ratio, 4, 2), seed=2, ep=Epilogue(rope_dim=16, rotate=rotate),
                 pooling="ring", max_n=4)
    run.run()
    run.check()
    assert standin and sum(k.calls for k in standin) > 0


def test_ring_on_the_cpu_is_the_gather_path():
    """No stand-in: on the CPU "ring" takes the plain-torch path, prefill included."""
    st = streaming.StreamState(2, 32, ratio=4, coff=2, dtype=torch.float32)
    run = Stream(st, _lens(4, 3, 5), seed=5, pooling="ring", max_n=3)
    run.run()
    run.check()


def test_ring_capture_branch_marks_bad_slots(standin, monkeypatch):
    """As test_the_capture_branch_poisons_instead_of_raising, through the ring path: the
    same rows as the eager gather path; a take-back past the last step and a step past
    max_seqlen make the slots bad and their rows NaN, and no eager check runs."""
    import importlib

    steps = importlib.import_module("csa_compressor.streaming.steps")
    kv, ape = torch.randn(3, 2, 32), torch.randn(4, 32)
    eager = streaming.StreamState(3, 16, ratio=4, coff=2, dtype=torch.float32, max_seqlen=9)
    captured = streaming.StreamState(3, 16, ratio=4, coff=2, dtype=torch.float32, max_seqlen=9)
    want = [streaming.decode(eager, kv, kv, ape) for _ in range(2)]
    monkeypatch.setattr(steps, "_capturing", lambda t: True)
    monkeypatch.setattr(steps, "_check_step", lambda *a: pytest.fail("checked under capture"))
    got = [streaming.decode(captured, kv, kv, ape, pooling="ring") for _ in range(2)]
    for a, b in zip(want, got):  # rows are meaningful where emitted
        assert torch.equal(a.emitted, b.emitted)
        assert torch.equal(a.rows[a.emitted], b.rows[b.emitted])
        assert torch.equal(a.positions[a.emitted], b.positions[b.emitted])
    assert want[1].emitted.all()
    streaming.take_back(captured, torch.tensor([0, 3, 0]))  # more than slot 1's last 2
    for _ in range(2):  # 9, 7, 9 tokens seen: within max_seqlen
        step = streaming.decode(captured, kv, kv, ape, [0, 1, 2], pooling="ring")
    assert captured.bad[:3].tolist() == [False, True, False]
    assert step.rows[1].isnan().all() and not step.rows[0::2].isnan().any()
    step = streaming.decode(captured, kv, kv, ape, pooling="ring")  # past max_seqlen
    assert captured.bad[:3].tolist() == [True, True, True]
    assert step.rows.isnan().all()
    assert captured.count[:3].tolist() == [10, 8, 10]


def test_decode_has_its_kernel_where_the_forward_holds_the_window_and_row():
    t = tuning.current()
    assert plan.decode_designable(torch.bfloat16, 4, 2, 512, t)
    assert plan.decode_designable(torch.float32, 2, 1, 512, t)
    assert not plan.decode_designable(torch.bfloat16, 128, 1, 512, t)  # slot-parallel window
    assert not plan.decode_designable(torch.float32, 4, 2, 8192, t)  # wider than a CTA
    s = plan.spec("decode", torch.bfloat16, 4, 2, 512, row_stride=2048, batch=3, ape=False)
    assert (s.row_stride, s.batch, s.ape, s.epilogue) == (0, 0, True, None)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1), (1, 1)])
def test_ring_prefill_tail_gives_the_rows_and_state(fused_on_cpu, standin, tail_standin,
                                                    ratio, coff):
    """prefill(pooling="ring") on the fused path (the reference standing in for the
    pooling kernels) with the tail kernel's stand-in: the same rows, slots, positions and
    counts (Stream.check compares the host's counts with the device's)."""
    st = streaming.StreamState(3, 32, ratio=ratio, coff=coff, dtype=torch.float32)
    run = Stream(st, _lens(ratio, 5, 11), seed=11, pooling="ring", max_n=3)
    run.run()
    run.check()
    assert sum(k.calls for k in tail_standin) > 0


def test_ring_prefill_uploads_its_ints_once(fused_on_cpu, standin, tail_standin, monkeypatch):
    """Prompts into empty slots on the fused path with the tail kernel: the pooling's
    offsets and the tail's per-slot ints reach the device in one host-to-device copy
    (each copy costs tens of µs of host time, a prefill's whole budget being about the
    training forward's); the rows are still the training rows."""
    from csa_compressor.streaming import chunks

    uploads = []
    real = chunks.device_ints
    for module in (chunks, ring):
        monkeypatch.setattr(module, "device_ints",
                            lambda *a, **k: uploads.append(a) or real(*a, **k), raising=False)
    st = streaming.StreamState(4, 32, ratio=4, coff=2, dtype=torch.float32)
    run = Stream(st, [37, 8, 0, 19], seed=3, pooling="ring")
    run.prefill([(s, s, n) for s, n in enumerate(run.lens)])
    run.check()
    assert len(uploads) == 1 and sum(k.calls for k in tail_standin) == 1


def test_prefill_takes_the_fresh_pack_only_into_empty_slots(fused_on_cpu, standin, tail_standin,
                                                            monkeypatch):
    """chunks._fresh (the caller's offsets as the pack, no window plan) serves a call
    whose slots all start empty, without the epilogue or a gradient, and gives the
    training rows; a call with a slot holding tokens, a gradient or the epilogue takes
    the planned packs."""
    from csa_compressor.streaming import chunks

    taken = []
    fresh = chunks._fresh
    monkeypatch.setattr(chunks, "_fresh", lambda *a: taken.append(a[6]) or fresh(*a))
    st = streaming.StreamState(4, 32, ratio=4, coff=2, dtype=torch.float32)
    run = Stream(st, [37, 8, 0, 19], seed=3, pooling="ring")
    run.prefill([(0, 0, 10), (2, 2, 0), (3, 3, 19)])
    run.prefill([(0, 0, 27), (1, 1, 8)])  # slot 0 holds 10 tokens
    run.check()
    assert taken == [[0, 2, 3]]
    kv = torch.randn(8, 64, requires_grad=True)
    for slots, extra in (([1], {}), ([3], {"epilogue": Epilogue(rope_dim=16), "norm_weight": torch.ones(32)})):
        st.reset(slots)
        got = streaming.prefill(st, kv, kv, None, [0, 8], slots, **extra)
        assert got.rows.shape[0] == 2 and taken == [[0, 2, 3]]
    assert got.rows.requires_grad


@pytest.mark.parametrize("pooling", ["fused", "ring"])
def test_prefill_sends_every_host_list_through_the_staging(fused_on_cpu, standin, tail_standin,
                                                           monkeypatch, pooling):
    """Every index list a prefill uploads, on either path and with boundary rows (chunks
    cut mid-window), goes through the state's pinned staging: an unstaged copy allocates
    pinned memory, which waited for the GPU whenever earlier copies were still queued
    (bench --streaming's GPU time caught the fused path doing so)."""
    from csa_compressor.streaming import chunks, state as state_mod, uploads, windows

    marker, seen = object(), []
    monkeypatch.setattr(state_mod.StreamState, "staging", lambda self: marker)
    real = uploads.device_ints

    def spy(values, device, dtype=torch.int64, staging=None, scratch=False, shapes=None):
        seen.append(staging)
        return real(values, device, dtype, shapes=shapes)

    for module in (chunks, windows, state_mod):
        monkeypatch.setattr(module, "device_ints", spy)
    st = streaming.StreamState(4, 32, ratio=4, coff=2, dtype=torch.float32)
    run = Stream(st, [35, 9, 700, 19], seed=5, pooling=pooling)
    run.prefill([(0, 0, 5), (1, 1, 3), (2, 2, 300)])
    run.prefill([(0, 0, 30), (1, 1, 6), (2, 2, 400), (3, 3, 19)])
    run.check()
    assert seen and all(s is marker for s in seen)


@pytest.mark.parametrize("pooling", ["fused", "ring"])
def test_no_number_is_assigned_through_a_tensor_index(fused_on_cpu, standin, tail_standin,
                                                      monkeypatch, pooling):
    """``t[idx] = 0`` with ``idx`` a tensor copies the 0 to the device and synchronises
    (tools/streaming_sync_probe.py found the fused prefill waiting there on an H200); no
    prefill path and no reset of given slots does it."""
    real, hits = torch.Tensor.__setitem__, []

    def spy(self, index, value):
        if isinstance(index, torch.Tensor) and isinstance(value, (bool, int, float)):
            hits.append((tuple(self.shape), value))
        return real(self, index, value)

    st = streaming.StreamState(4, 32, ratio=4, coff=2, dtype=torch.float32)
    run = Stream(st, [35, 9, 70, 19], seed=5, pooling=pooling)
    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    run.prefill([(0, 0, 5), (1, 1, 3), (2, 2, 30)])
    run.prefill([(0, 0, 30), (1, 1, 6), (2, 2, 40), (3, 3, 19)])
    st.reset(torch.tensor([1, 3]))
    st.reset([0])
    assert hits == []


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1), (1, 1)])
def test_fresh_prefill_writes_its_offsets_by_launch_not_upload(fused_on_cpu, standin,
                                                               tail_standin, monkeypatch,
                                                               ratio, coff):
    """A prefill into empty slots takes its offsets and the tail's ints from
    kernels/prefill_offsets (its stand-in here) in a scratch twin, uploads nothing, and
    gives the training rows; with more slots than the largest capacity, or no twin free,
    it uploads them as before."""
    from csa_compressor.kernels.prefill_offsets import CAPACITIES
    from csa_compressor.streaming import chunks, state as state_mod, uploads
    from kernel_standin import PrefillOffsetsStandin
    from test_uploads_cpu import raw_staging

    launched, uploads_seen = [], []
    staging = raw_staging(buffers=2)
    monkeypatch.setattr(state_mod.StreamState, "staging", lambda self: staging)

    def launcher(state, slots):
        cap = next((c for c in CAPACITIES if c >= slots), None)
        if cap is None:
            return None
        k = PrefillOffsetsStandin(state.ratio, cap)
        launched.append(k)
        return k.fn, cap

    monkeypatch.setattr(ring, "offsets_launcher", launcher)
    real = uploads.device_ints
    monkeypatch.setattr(chunks, "device_ints",
                        lambda values, *a, **k: uploads_seen.append(values) or real(values, *a, **k))

    def one_call(B):
        launched.clear(), uploads_seen.clear()
        st = streaming.StreamState(B, 16, ratio=ratio, coff=coff, dtype=torch.float32)
        lens = [(7 * b + 3) % (3 * ratio + 5) for b in range(B)]
        run = Stream(st, lens, seed=B, pooling="ring")
        run.prefill([(B - 1 - b, b, lens[b]) for b in range(B)])  # slots in reverse
        run.check()

    for B in (3, 9, CAPACITIES[-1]):
        one_call(B)
        assert len(launched) == 1 and launched[0].calls == 1 and not uploads_seen
    one_call(CAPACITIES[-1] + 1)
    assert not launched and len(uploads_seen) == 1
    staging.raw.stream_id = 7  # the next twin's last reader on another stream
    one_call(2)
    assert len(uploads_seen) == 1 and sum(k.calls for k in launched) == 0
