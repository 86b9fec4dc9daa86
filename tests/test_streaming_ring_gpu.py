"""The one-launch kernels of pooling="ring" (kernels/pool_decode, kernels/prefill_tail) on
the H200: every emitted row bitwise the fused training op's, in eager numerics and
replayed in a CUDA graph; the same rows and state as the gather path; malformed entries
NaN and their slots bad in a graph (both paths). The generation loop over both paths is
tests/test_streaming_gpu.py's."""

import pytest
import torch

from csa_compressor import Epilogue, streaming
from csa_compressor.streaming import ring
from stream_driver import Stream, captured_replay, random_lens, takes_the_ring_kernel

pytestmark = pytest.mark.gpu

def _lens(ratio, k, seed):
    return random_lens(ratio, k, seed, 4 * ratio + 40)


@pytest.mark.parametrize("numerics", ["fp32", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_eager_numerics(numerics, dtype):
    st = streaming.StreamState(3, 512, ratio=4, coff=2, dtype=dtype, device="cuda")
    assert takes_the_ring_kernel(st, numerics=numerics)
    run = Stream(st, _lens(4, 5, 1), seed=1, numerics=numerics, pooling="ring", max_n=3)
    run.run()
    run.check(fused=True)


def _steps(pooling, ape, steps=12, B=5, n=3, ratio=4, coff=2, d=128, seed=0):
    """``steps`` decode steps of ``n`` tokens into fresh states; the steps and the state."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    st = streaming.StreamState(B + 2, d, ratio=ratio, coff=coff, device=dev)
    slots = torch.tensor([5, 0, 3, 6, 1][:B], device=dev)
    out = []
    for _ in range(steps):
        kv = torch.randn(B, n, coff * d, device=dev, generator=g).bfloat16()
        sc = torch.randn(B, n, coff * d, device=dev, generator=g).bfloat16()
        out.append(streaming.decode(st, kv, sc, ape, slots, pooling=pooling))
    return out, st


@pytest.mark.parametrize("with_ape", [True, False])
def test_ring_steps_and_state_are_the_gather_paths(with_ape):
    ape = torch.randn(4, 256, device="cuda") if with_ape else None
    ring_steps, ring_state = _steps("ring", ape)
    gather_steps, gather_state = _steps("fused", ape)
    emitted = 0
    for a, b in zip(ring_steps, gather_steps):
        assert torch.equal(a.emitted, b.emitted)
        assert torch.equal(a.rows[a.emitted], b.rows[b.emitted])
        assert torch.equal(a.positions[a.emitted], b.positions[b.emitted])
        emitted += int(a.emitted.sum())
    assert emitted > 0
    for name in ("count", "last_n", "bad", "kv", "score"):
        assert torch.equal(getattr(ring_state, name), getattr(gather_state, name)), name


def test_ring_without_an_ape_is_a_zero_ape():
    zero, _ = _steps("ring", torch.zeros(4, 256, device="cuda"))
    none, _ = _steps("ring", None)
    for a, b in zip(zero, none):
        assert torch.equal(a.rows[a.emitted], b.rows[b.emitted])


@pytest.mark.parametrize("ratio,coff,dtype,ep", [(4, 2, torch.bfloat16, None),
                                                 (4, 2, torch.bfloat16, Epilogue(rope_dim=64)),
                                                 (2, 1, torch.float32, None)])
def test_ring_captured_decode_replays_64_steps(ratio, coff, dtype, ep):
    st = streaming.StreamState(8, 512, ratio=ratio, coff=coff, dtype=dtype, device="cuda")
    assert takes_the_ring_kernel(st, 8)
    captured_replay(ratio, coff, dtype, ep, "ring")


@pytest.mark.parametrize("pooling", ["ring", "fused"])
def test_captured_decode_poisons_malformed_entries(pooling):
    """Both paths alike inside a graph: a slot out of range, a repeated one, one past
    max_seqlen; NaN rows, slots bad (the spare's too), an eager call on them raises."""
    dev = "cuda"
    st = streaming.StreamState(4, 128, ratio=4, coff=2, device=dev, max_seqlen=12)
    kv = torch.randn(4, 1, 256, device=dev).bfloat16()
    ape = torch.randn(4, 256, device=dev)
    slots = torch.arange(4, device=dev)
    streaming.decode(st, kv, kv, ape, slots, pooling=pooling)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streaming.decode(st, kv, kv, ape, slots, pooling=pooling)
    slots.copy_(torch.tensor([0, 1, 9, 1], device=dev))  # 9: out of range; 1 twice
    for _ in range(4):
        graph.replay()
    rows = out.rows.float()
    assert rows[2].isnan().all() and rows[1].isnan().all() and rows[3].isnan().all()
    assert not rows[0].isnan().any()
    assert st.bad[:4].tolist() == [False, True, False, False] and bool(st.bad[4])  # spare
    slots.copy_(torch.tensor([0, 2, 3, 1], device=dev))
    for _ in range(8):  # slot 0 reaches 13 tokens: past max_seqlen
        graph.replay()
    assert st.bad[:4].tolist() == [True, True, False, False]
    assert out.rows[0].float().isnan().all() and not out.rows[1:3].float().isnan().any()
    # eager, the step raises (slots 0 and 1 are past max_seqlen as well as bad)
    with pytest.raises(ValueError, match="reset it|capacity"):
        streaming.decode(st, kv, kv, ape, torch.tensor([1, 0, 2, 3]), pooling=pooling)


def test_captured_in_place_decode_poisons_malformed_entries():
    """Ratio 128's step over aligned rings (kernels/decode_entries, then the pooling in
    place) inside a graph: a slot out of range and a repeated one get NaN rows and bad
    slots (the spare's too); the well-formed entry's closing window is the gather path's
    row, bit for bit."""
    dev, d = "cuda", 128
    g = torch.Generator(device=dev).manual_seed(7)
    prompt = torch.randn(4 * 126, d, device=dev, generator=g).bfloat16()
    step = torch.randn(4, 1, d, device=dev, generator=g).bfloat16()
    ape = torch.randn(128, d, device=dev, generator=g)
    states = {}
    for pooling in ("ring", "fused"):
        st = states[pooling] = streaming.StreamState(4, d, ratio=128, coff=1, device=dev)
        streaming.prefill(st, prompt, prompt, ape, [0, 126, 252, 378, 504], [0, 1, 2, 3],
                          pooling=pooling)
        streaming.decode(st, step, step, ape, torch.arange(4, device=dev), pooling=pooling)
    st = states["ring"]
    slots = torch.arange(4, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streaming.decode(st, step, step, ape, slots, pooling="ring")
    slots.copy_(torch.tensor([0, 1, 9, 1], device=dev))  # 9: out of range; 1 twice
    graph.replay()  # slot 0's 128th token: its first window closes
    want = streaming.decode(states["fused"], step[:1], step[:1], ape, torch.tensor([0]),
                            pooling="fused")
    rows = out.rows.float()
    assert rows[1].isnan().all() and rows[2].isnan().all() and rows[3].isnan().all()
    assert bool(out.emitted[0, 0]) and int(out.positions[0, 0]) == 0
    assert torch.equal(out.rows[0], want.rows[0]) and bool(want.emitted[0, 0])
    assert st.bad[:4].tolist() == [False, True, False, False] and bool(st.bad[4])  # spare
    with pytest.raises(ValueError, match="reset it"):
        streaming.decode(st, step, step, ape, torch.tensor([1, 0, 2, 3]), pooling="ring")


@pytest.mark.parametrize("ratio,coff,dtype", [(4, 2, torch.bfloat16), (128, 1, torch.float32),
                                              (1, 1, torch.float16)])
def test_ring_prefill_is_the_gather_prefill(ratio, coff, dtype):
    """prefill(pooling="ring") (kernels/prefill_tail after the pooling) against
    pooling="fused" (torch ops): the same rows, slots, positions and state, over chunks
    that start and end mid-block, a slot that starts mid-call and one left out."""
    dev, d, B = "cuda", 128, 4
    g = torch.Generator(device=dev).manual_seed(ratio)
    states = {p: streaming.StreamState(B + 1, d, ratio=ratio, coff=coff, dtype=dtype, device=dev)
              for p in ("ring", "fused")}
    kv_probe = torch.zeros(1, coff * d, dtype=dtype, device=dev)
    assert ring.tail_launcher(states["ring"], kv_probe, kv_probe) is not None
    calls = [([3 * ratio + 1, ratio - 1, 0, 2 * ratio + 3], [0, 1, 2, 4]),
             ([ratio + 2, 5, 7 * ratio], [4, 0, 1]),
             ([1, 2 * ratio, ratio + 1, 9], [1, 2, 3, 0])]
    for lens, slots in calls:
        T, W = sum(lens), coff * d
        kv = torch.randn(T, W, device=dev, generator=g).to(dtype)
        sc = torch.randn(T, W, device=dev, generator=g).to(dtype)
        ape = torch.randn(ratio, W, device=dev, generator=g)
        cu = [0] + torch.tensor(lens).cumsum(0).tolist()
        got = {p: streaming.prefill(st, kv, sc, ape, cu, slots, pooling=p)
               for p, st in states.items()}
        for a, b in zip(got["ring"], got["fused"]):
            assert torch.equal(a, b)
    for name in ("count", "last_n", "bad", "kv", "score"):
        assert torch.equal(getattr(states["ring"], name), getattr(states["fused"], name)), name


@pytest.mark.parametrize("ratio,coff,with_ape,numerics", [(4, 2, True, "fp32"),
                                                          (4, 2, False, "eager"),
                                                          (128, 1, True, "eager"),
                                                          (128, 1, False, "fp32")])
def test_prefill_into_empty_slots_is_the_training_forward(ratio, coff, with_ape, numerics,
                                                           monkeypatch):
    """A call whose slots all start empty takes chunks._fresh (the caller's offsets, one
    upload, the kept pooling kernel and the tail): its rows bitwise the training op's over
    the same chunks and pooling="fused"'s, the same slots, positions and state."""
    from csa_compressor import compress_thd_fused
    from csa_compressor.streaming import chunks

    dev, d = "cuda", 512
    W, lens, slots = coff * d, [5 * ratio + 3, ratio - 1, 0, 9 * ratio], [3, 0, 4, 1]
    g = torch.Generator(device=dev).manual_seed(ratio + coff)
    kv = torch.randn(sum(lens), W, device=dev, generator=g).bfloat16()
    sc = torch.randn(sum(lens), W, device=dev, generator=g).bfloat16()
    ape = torch.randn(ratio, W, device=dev, generator=g) if with_ape else None
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    taken, launched = [], []
    fresh, offsets = chunks._fresh, ring.fresh_offsets
    monkeypatch.setattr(chunks, "_fresh", lambda *a: taken.append(1) or fresh(*a))
    monkeypatch.setattr(ring, "fresh_offsets",
                        lambda *a: launched.append(offsets(*a)) or launched[-1])
    got = {}
    for pooling in ("ring", "fused"):
        st = streaming.StreamState(5, d, ratio=ratio, coff=coff, device=dev)
        got[pooling] = (streaming.prefill(st, kv, sc, ape, cu, slots, pooling=pooling,
                                          numerics=numerics), st)
    assert taken == [1] and len(launched) == 1 and launched[0] is not None  # prefill_offsets
    rows = [n // ratio for n in lens]
    cuc = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    want = compress_thd_fused(kv, sc, ape, torch.tensor(cu, dtype=torch.int32, device=dev), cuc,
                              sum(rows), ratio=ratio, coff=coff, numerics=numerics)
    (a, st_a), (b, st_b) = got["ring"], got["fused"]
    assert torch.equal(a.rows, want) and torch.equal(b.rows, want)
    assert torch.equal(a.slots, b.slots) and torch.equal(a.positions, b.positions)
    assert a.slots.tolist() == [s for s, k in zip(slots, rows) for _ in range(k)]
    for name in ("count", "last_n", "bad", "kv", "score"):
        assert torch.equal(getattr(st_a, name), getattr(st_b, name)), name
    assert st_a.count[:5].tolist() == [lens[1], lens[3], 0, lens[0], lens[2]]


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_prefill_offsets_writes_what_the_upload_carried(ratio):
    """kernels/prefill_offsets (ring.fresh_offsets) writes, for 1 to 64 call slots, the
    values a prefill into empty slots uploads otherwise: the offsets, the row offsets and
    the tail kernel's ints; past its largest capacity it declines (the upload)."""
    import itertools
    import random

    rng = random.Random(ratio)
    st = streaming.StreamState(80, 64, ratio=ratio, coff=1, device="cuda")
    for B in (1, 5, 8, 9, 16, 17, 40, 64):
        lens = [rng.choice([0, 1, ratio - 1, ratio, 3 * ratio + 1, rng.randint(0, 70000)])
                for _ in range(B)]
        cu = [0, *itertools.accumulate(lens)]
        slots = rng.sample(range(80), B)
        rows = [n // ratio for n in lens]
        meta = ring.tail_meta(slots, cu, lens, [0] * B, rows)
        got = ring.fresh_offsets(st, cu, slots)
        assert [t.tolist() for t in got] == [cu, [0, *itertools.accumulate(rows)],
                                             [meta[5 * b:5 * b + 5] for b in range(B)]], B
    assert ring.fresh_offsets(st, list(range(66)), list(range(65))) is None


@pytest.mark.parametrize("pooling", ["fused", "ring"])
def test_prefill_into_known_slots_never_waits_for_the_gpu(pooling):
    """With offsets and slots as host lists and the counts in the host's record, a prefill
    reads nothing from the device (torch's sync debug mode raises on a synchronising op;
    the fused path once copied a number to the device for ``last_n[idx] = 0``)."""
    dev = torch.device("cuda")
    st = streaming.StreamState(4, 128, ratio=4, coff=2, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(300, 256, device=dev).bfloat16()
    ape = torch.randn(4, 256, device=dev)
    streaming.prefill(st, kv, kv, ape, [0, 100, 300], [0, 2], pooling=pooling)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = streaming.prefill(st, kv, kv, ape, [0, 37, 300], [1, 2], pooling=pooling)
        st.reset([0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.rows.shape[0] == 37 // 4 + (200 + 263) // 4 - 200 // 4


def test_reset_of_device_slots_is_captured_and_replayed():
    """reset(slots) with the slots on the device inside a CUDA graph: replays empty those
    slots and leave the others."""
    dev = torch.device("cuda")
    st = streaming.StreamState(4, 128, ratio=4, coff=2, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(40, 256, device=dev).bfloat16()
    ape = torch.randn(4, 256, device=dev)
    which = torch.tensor([1, 3], device=dev)
    st.reset(which)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        st.reset(which)
    streaming.prefill(st, kv, kv, ape, [0, 10, 20, 30, 40], [0, 1, 2, 3])
    g.replay()
    torch.cuda.synchronize()
    assert st.count[:4].tolist() == [10, 0, 10, 0]
