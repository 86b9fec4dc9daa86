"""csa_compressor.streaming on the plain-torch path (CPU): every row a generation loop
emits is bitwise the training reference's row for that window; state round-trips (bad
input: test_streaming_errors_cpu.py)."""

import pytest
import torch

from csa_compressor import Epilogue, streaming
from stream_driver import Stream, random_lens

# (ratio, coff) the issue names: ratio 4 with overlap, 128 without, and 1, 2, 8
CONFIGS = [(4, 2), (128, 1), (1, 1), (2, 1), (8, 1)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _lens(ratio, k, seed):
    return random_lens(ratio, k, seed, 3 * ratio + 20)


@pytest.mark.parametrize("ratio,coff", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", [None, Epilogue(rope_dim=16)])
def test_generation_rows_are_the_training_rows(ratio, coff, dtype, epilogue):
    st = streaming.StreamState(3, 64, ratio=ratio, coff=coff, dtype=dtype)
    run = Stream(st, _lens(ratio, 5, ratio), seed=ratio + coff, ep=epilogue, max_n=4)
    run.run()
    run.check()


@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("numerics", ["fp32", "eager"])
def test_head_dims_and_eager_numerics(head_dim, numerics):
    for ratio, coff in ((4, 2), (128, 1)):
        st = streaming.StreamState(2, head_dim, ratio=ratio, coff=coff)
        run = Stream(st, _lens(ratio, 3, head_dim), seed=head_dim, numerics=numerics,
                     ep=Epilogue(rope_dim=64, rotate=head_dim == 128), max_n=2)
        run.run()
        run.check()


def test_one_prompt_cut_anywhere_gives_one_call_rows():
    st1 = streaming.StreamState(1, 32, ratio=4, coff=2, dtype=torch.float32)
    st2 = streaming.StreamState(1, 32, ratio=4, coff=2, dtype=torch.float32)
    kv, sc, ape = torch.randn(103, 64), torch.randn(103, 64), torch.randn(4, 64)
    whole = streaming.prefill(st1, kv, sc, ape, [0, 103], [0])
    rows = []
    for a, b in ((0, 1), (1, 6), (6, 7), (7, 8), (8, 60), (60, 103)):
        rows.append(streaming.prefill(st2, kv[a:b], sc[a:b], ape, [0, b - a], [0]).rows)
    assert torch.equal(torch.cat(rows), whole.rows)
    assert whole.positions.tolist() == [4 * i for i in range(25)]
    assert torch.equal(st1.count, st2.count) and int(st1.count[0]) == 103


def test_state_dict_round_trip_continues_the_stream():
    st = streaming.StreamState(2, 32, ratio=4, coff=2, dtype=torch.bfloat16)
    kv = torch.randn(40, 64).bfloat16()
    sc = torch.randn(40, 64).bfloat16()
    ape = torch.randn(4, 64)
    streaming.prefill(st, kv[:13], sc[:13], ape, [0, 6, 13], [0, 1])
    saved = st.state_dict()
    fresh = streaming.StreamState(2, 32, ratio=4, coff=2, dtype=torch.bfloat16)
    fresh.load_state_dict(saved)
    a = streaming.decode(st, kv[13:17].view(2, 2, 64), sc[13:17].view(2, 2, 64), ape)
    b = streaming.decode(fresh, kv[13:17].view(2, 2, 64), sc[13:17].view(2, 2, 64), ape)
    assert torch.equal(a.emitted, b.emitted) and torch.equal(a.positions, b.positions)
    assert torch.equal(a.rows[a.emitted], b.rows[b.emitted]) and bool(a.emitted.any())
    other = streaming.StreamState(2, 32, ratio=8, coff=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"state_dict\['ratio'\]"):
        other.load_state_dict(saved)


def test_decode_shapes_are_static():
    st = streaming.StreamState(4, 16, ratio=2, coff=1, dtype=torch.float32, max_next_n=3)
    kv, sc, ape = torch.randn(4, 3, 16), torch.randn(4, 3, 16), torch.randn(2, 16)
    step = streaming.decode(st, kv, sc, ape)
    assert step.rows.shape == (4, 2, 16) and step.emitted.shape == (4, 2)
    assert step.emitted[:, 0].all() and not step.emitted[:, 1].any()
    step = streaming.decode(st, kv, sc, ape)  # 3 seen + 3: blocks 1 and 2 close
    assert step.emitted.all() and step.positions.tolist() == [[2, 4]] * 4


@pytest.mark.parametrize("ratio,coff", [(4, 2), (4, 1), (1, 1), (3, 2)])
def test_each_row_comes_from_one_pack_once(ratio, coff):
    """Every closing block is kept from exactly one pack (a row kept twice would be an
    unordered write on the GPU), and each pack's segment holds what its rows read."""
    from csa_compressor.streaming.windows import plan

    for c in range(0, 3 * ratio):
        for n in range(0, 3 * ratio):
            for w in plan([c, 5], [n, 2 * ratio], ratio, coff)[:1]:
                kept = list(range(w.j0, w.last + 1)) + list(range(w.a + w.junk, w.i1))
                assert kept == list(range(w.i0, w.i1)), (c, n, w)
                if w.bnd_rows:  # the boundary segment: some held tokens, the rest new
                    t_lo, t_hi = (w.j0 - w.shift) * ratio, (w.last + 1) * ratio
                    assert t_lo < c and c <= t_hi <= c + n, (c, n, w)
                    assert w.shift == (coff == 2 and w.j0 > 0)
                if w.junk:  # the body's first row lacks its previous block
                    assert coff == 2 and w.a > 0
                assert 0 <= w.head < ratio and w.head + w.body_rows * ratio <= n


def test_the_example_runs(capsys):
    import os
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "examples",
                                "streaming_generation.py"), run_name="__main__")
    assert "bitwise the training forward's" in capsys.readouterr().out


def test_streaming_bench_floor_and_table():
    from csa_compressor.cli import streaming_bench as sb

    # ratio 4, coff 2, d 512, bf16: 256 x (4*1024*2 + 512*2) bytes and 64 windows of
    # 2*8*512*2; ratio 128, coff 1: 256 x (4*512*2 + 512*2) and 2 windows of 2*128*512*2
    assert sb.decode_floor_bytes(4, 2, 512, 2) == 256 * (8192 + 1024) + 64 * 16384
    assert sb.decode_floor_bytes(128, 1, 512, 2) == 256 * (4096 + 1024) + 2 * 262144
    st = streaming.StreamState(6, 16, ratio=4, coff=2)
    sb.staggered(st, torch.Generator().manual_seed(0))
    assert st.count[:6].tolist() == [8, 9, 10, 11, 8, 9]
    text = sb.table([{"case": "decode x", "streaming ring": 3.5, "streaming fused": 12.5,
                      "floor": 1.5}], {"copy_bandwidth_gbs": 4000.0, "launch_floor_us": 2.0})
    assert "| decode x |  | 3.5 | 12.5 |  | 1.5 |" in text.splitlines()
    assert "launch floor (one captured elementwise kernel) 2.00 µs" in text


def test_streaming_bench_table_has_the_prefill_gpu_time():
    from csa_compressor.cli import streaming_bench as sb

    text = sb.table([{"case": "prefill x", "training forward": 84.0, "streaming ring": 120.0,
                      "training forward GPU": 59.0, "streaming ring GPU": 63.5}],
                    {"copy_bandwidth_gbs": 4000.0, "launch_floor_us": 2.0})
    assert "| prefill x | 59.0 | 63.5 |  |" in text.splitlines()
    assert "| prefill x | 84.0 | 120.0 |  |  |  |" in text.splitlines()


def test_streaming_bench_keeps_a_figure_when_the_other_measure_fails():
    from csa_compressor.cli import streaming_bench as sb

    def fails():
        raise RuntimeError("the call's host time (2532 µs) outlasted the spin")

    row = {"case": "prefill x", "training forward": 84.0, "streaming fused": sb._measured(
        lambda: 463.5), "streaming fused GPU": sb._measured(fails)}
    text = sb.table([row], {"copy_bandwidth_gbs": 4000.0, "launch_floor_us": 2.0})
    assert "| prefill x | 84.0 |  | 463.5 |  |  |" in text.splitlines()
    assert any(line.startswith("| prefill x |  |  | RuntimeError: the call's host time")
               for line in text.splitlines())


def test_the_submodule_resolves_from_the_package():
    import csa_compressor

    assert csa_compressor.streaming.decode is streaming.decode


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1), (2, 1)])
@pytest.mark.parametrize("pooling", ["fused", "auto"])
def test_the_fused_path_plumbing(fused_on_cpu, monkeypatch, ratio, coff, pooling):
    """The fused path down to the launch (the reference standing in for the kernels):
    the packs, their offsets, capacities and positions as the kernels would get them, each
    pack's problem marked as offsets the stream built (no device-side check); with "auto",
    a pack of the caller's own tensors is not validated a second time."""
    from csa_compressor import dispatch, ops

    built, launch = [], ops.fused_from_problem
    monkeypatch.setattr(ops, "fused_from_problem",
                        lambda p, finish=None: built.append(p.offsets_built) or launch(p, finish))
    checks, check = [], dispatch.validate
    monkeypatch.setattr(dispatch, "validate", lambda *a, **k: checks.append(1) or check(*a, **k))
    calls = []
    for name in ("prefill", "decode"):
        monkeypatch.setattr(streaming, name, lambda *a, _f=getattr(streaming, name), **k:
                            calls.append(1) or _f(*a, **k))
    st = streaming.StreamState(3, 64, ratio=ratio, coff=coff)
    run = Stream(st, _lens(ratio, 4, 7), seed=3, ep=Epilogue(rope_dim=16), pooling=pooling,
                 max_n=3)
    run.kw["epilogue_inside"] = ("fwd", "bwd")  # passed on to the op
    run.run()
    run.check()
    assert fused_on_cpu and min(fused_on_cpu) >= 2  # packs padded past the few-row orders
    assert len(built) == len(fused_on_cpu) and all(built)
    if pooling == "auto":  # one check a call for the path, one a pack not the caller's
        assert len(checks) - len(calls) <= len(built)
        if ratio < 128:  # these streams pool body packs of the caller's tensors
            assert len(checks) - len(calls) < len(built)


def test_the_capture_branch_poisons_instead_of_raising(monkeypatch):
    """decode and take_back as they run inside a CUDA-graph capture (nothing read on the
    host): the same rows, and malformed input marks the slot bad (NaN rows) instead."""
    import importlib

    steps = importlib.import_module("csa_compressor.streaming.steps")
    kv, ape = torch.randn(3, 2, 32), torch.randn(4, 32)
    eager = streaming.StreamState(3, 16, ratio=4, coff=2, dtype=torch.float32, max_seqlen=9)
    captured = streaming.StreamState(3, 16, ratio=4, coff=2, dtype=torch.float32, max_seqlen=9)
    want = [streaming.decode(eager, kv, kv, ape) for _ in range(2)]
    monkeypatch.setattr(steps, "_capturing", lambda t: True)
    got = [streaming.decode(captured, kv, kv, ape) for _ in range(2)]
    for a, b in zip(want, got):
        assert torch.equal(a.rows, b.rows) and torch.equal(a.emitted, b.emitted)
    streaming.take_back(captured, torch.tensor([0, 3, 0]))  # more than slot 1's last 2
    for _ in range(2):  # 9, 7, 9 tokens seen: within max_seqlen
        step = streaming.decode(captured, kv, kv, ape, [0, 1, 2])
    assert captured.bad[:3].tolist() == [False, True, False]
    assert step.rows[1].isnan().all() and not step.rows[0::2].isnan().any()
    step = streaming.decode(captured, kv, kv, ape)  # 11 > max_seqlen for slots 0 and 2
    assert captured.bad[:3].tolist() == [True, True, True]
    assert step.rows.isnan().all()
    captured.reset([0])
    assert captured.bad[:3].tolist() == [False, True, True]
    # a capture may replay unseen: from here prefill reads the device's counts
    assert captured.captured and captured.host_counts is None
    assert eager.host_counts == eager.count[:3].tolist() == [4, 4, 4]


def test_empty_calls_and_chunks():
    st = streaming.StreamState(2, 16, ratio=4, coff=2, dtype=torch.float32)
    ape = torch.randn(4, 32)
    out = streaming.prefill(st, torch.randn(0, 32), torch.randn(0, 32), ape, [0], [])
    assert out.rows.shape == (0, 16) and out.slots.shape == (0,)
    out = streaming.prefill(st, torch.randn(9, 32), torch.randn(9, 32), ape, [0, 0, 9], [0, 1])
    assert out.slots.tolist() == [1, 1] and out.positions.tolist() == [0, 4]
    assert st.count[:2].tolist() == [0, 9]
    for slots in ([1.5], torch.tensor([0.0])):
        with pytest.raises(TypeError, match="slots"):
            streaming.prefill(st, torch.randn(5, 32), torch.randn(5, 32), ape, [0, 5], slots)


def test_the_host_counts_follow_or_step_aside():
    """prefill reads no counts from the device while the host could follow every change;
    a change it cannot follow (device-resident k here stands in for one) hands back to the
    device's counts, with the same rows."""
    st = streaming.StreamState(2, 16, ratio=4, coff=2, dtype=torch.float32)
    kv, ape = torch.randn(20, 32), torch.randn(4, 32)
    streaming.prefill(st, kv[:10], kv[:10], ape, [0, 3, 10], [0, 1])
    streaming.decode(st, kv[:4].view(2, 2, 32), kv[:4].view(2, 2, 32), ape)
    streaming.take_back(st, torch.tensor([1, 0]))
    assert st.host_counts == st.count[:2].tolist() == [4, 9]
    st.reorder(torch.tensor([1, 0]))
    assert st.host_counts == [9, 4]
    st.host_counts = None  # as after a change the host did not see
    out = streaming.prefill(st, kv[10:14], kv[10:14], ape, [0, 4], [1])
    assert st.host_counts == [9, 8] and out.positions.tolist() == [4]
    st.load_state_dict(st.state_dict())
    assert st.host_counts is None


def test_packs_are_padded_past_the_row_counts_where_torch_reorders():
    from csa_compressor.softmax_order import ROWSUM_MIN_ROWS
    from csa_compressor.streaming.windows import min_rows

    assert min_rows(0, 512, True) == 0
    assert min_rows(1, 512) == 1 and min_rows(1, 64) == 2 and min_rows(3, 32) == 4
    assert min_rows(1, 512, True) == ROWSUM_MIN_ROWS == 16
    assert min_rows(40, 64, True) == 40


def test_prefill_reads_its_slots_on_the_host_only(monkeypatch):
    """prefill checks a host list of slots there and never builds a device copy of them
    (reading one back would sync the host with the GPU at every call)."""
    st = streaming.StreamState(3, 16, ratio=4, coff=2, dtype=torch.float32)
    kv, ape = torch.randn(9, 32), torch.randn(4, 32)

    def no_device_copy(*a, **k):
        raise AssertionError("prefill built a device tensor of its slots")

    monkeypatch.setattr(streaming.StreamState, "slot_index", no_device_copy)
    rows = streaming.prefill(st, kv, kv, ape, [0, 4, 9], [2, 0])
    assert rows.slots.tolist() == [2, 0] and st.counts_of([0, 1, 2]) == [5, 0, 4]
    with pytest.raises(ValueError, match="slot 3 at index 1 is out of range"):
        streaming.prefill(st, kv, kv, ape, [0, 4, 9], [2, 3])


def test_rotary_frequencies_are_made_once_a_state_and_never_while_capturing(monkeypatch):
    """rows.rope_freqs: the tensor the epilogue would make (rotary.rope_inv_freq), kept a
    state and Epilogue; none made while a graph captures (its values would not exist
    outside the graph), and none for a caller's table or an epilogue without rotary."""
    from csa_compressor.rotary import YaRN, rope_inv_freq
    from csa_compressor.streaming import rows

    st = streaming.StreamState(2, 64, ratio=4, coff=2, dtype=torch.float32)
    ep = Epilogue(rope_dim=32, rope_yarn=YaRN(factor=4.0, original_max_position_embeddings=64))
    monkeypatch.setattr(streaming.StreamState, "capturing", lambda self: True)
    assert rows.rope_freqs(st, ep) is None
    monkeypatch.undo()
    got = rows.rope_freqs(st, ep)
    assert torch.equal(got, rope_inv_freq(32, ep.rope_theta, ep.rope_yarn))
    assert rows.rope_freqs(st, ep) is got
    assert rows.rope_freqs(st, Epilogue(rope_dim=32)) is not got
    assert rows.rope_freqs(st, Epilogue(rope_dim=0)) is None
    x = torch.zeros(8, 128)
    s = rows.settings(st, x, x, None, "fp32", ep, torch.ones(64), None, "reference")
    assert s.inv_freq is got
    table = (torch.zeros(64, 16), torch.zeros(64, 16))
    assert rows.settings(st, x, x, None, "fp32", ep, torch.ones(64), table,
                         "reference").inv_freq is None


def test_long_coff_one_windows_keep_aligned_rings():
    """Ratio 128 at coff 1 keeps a ring of one window (max_next_n 1) or two, so no window
    wraps and decode pools it in place; other configurations keep coff*ratio + max_next_n
    tokens."""
    from csa_compressor.streaming.state import history

    assert history(128, 1, 1) == (128, True) and history(128, 1, 4) == (256, True)
    assert history(32, 1, 4) == (64, True)
    assert history(16, 1, 4) == (20, False)  # short windows: the decode kernel's
    assert history(4, 2, 4) == (12, False) and history(128, 2, 4) == (260, False)
    assert history(128, 1, 129) == (257, False)  # a step past a whole window
    st = streaming.StreamState(2, 16, ratio=128, coff=1, max_next_n=2)
    assert st.kv.shape == (3, 256, 16) and st.aligned


@pytest.mark.parametrize("max_n", [1, 4])
def test_aligned_decode_on_the_fused_path_is_the_training_rows(fused_on_cpu, max_n):
    """steps._in_place (the kernels stood in by a row-by-row reference of their contract):
    chunked prefill, decode of up to max_n tokens with take-backs, every row the
    reference training forward's."""
    st = streaming.StreamState(3, 32, ratio=128, coff=1, max_next_n=max_n)
    run = Stream(st, [300, 129, 260, 140], seed=max_n, pooling="auto", max_n=max_n)
    run.run()
    run.check()
    assert fused_on_cpu


@pytest.mark.parametrize("max_n", [1, 3])
def test_aligned_decode_through_the_entries_kernel_is_the_training_rows(fused_on_cpu,
                                                                       monkeypatch, max_n):
    """ring.in_place (kernels/decode_entries stood in by its contract, the pooling by a
    row-by-row reference of its kernels'): every row the reference training forward's,
    and the state the torch ops' (steps._in_place)."""
    from kernel_standin import DecodeEntriesStandin
    from csa_compressor import dispatch
    from csa_compressor.streaming import ring, steps

    made, ring_checks = [], []
    check = dispatch.validate  # fused_on_cpu's
    monkeypatch.setattr(dispatch, "validate", lambda kv, *a, **k: ring_checks.append(
        kv.shape[0] == st.flat_rings()[0].shape[0]) or check(kv, *a, **k))

    def launcher(state, kv, score):
        made.append(DecodeEntriesStandin(state.ratio))
        return made[-1].fn

    lens = [300, 129, 260, 140]
    states, taken = {}, []
    torch_ops = steps._in_place
    monkeypatch.setattr(steps, "_in_place", lambda *a: taken.append(1) or torch_ops(*a))
    for kernel in (True, False):
        with monkeypatch.context() as m:
            if kernel:
                m.setattr(ring, "entries_launcher", launcher)
            st = states[kernel] = streaming.StreamState(3, 32, ratio=128, coff=1,
                                                        max_next_n=max_n)
            torch.manual_seed(0)  # the drafts' noise tokens, taken back, alike both ways
            run = Stream(st, lens, seed=max_n, pooling="auto", max_n=max_n)
            run.run()
            run.check()
        if kernel:
            assert made and sum(k.calls for k in made) > 0 and not taken
    assert taken  # the second run took the torch ops
    # the rings take the verdict kept for the state's tensor layout (rows.fused_problem):
    # no validation of theirs in any step either way, a few of the callers' tensors in all
    assert ring_checks and not any(ring_checks) and len(ring_checks) <= 6
    for name in ("kv", "score", "count", "last_n", "bad"):
        assert torch.equal(getattr(states[True], name), getattr(states[False], name)), name


def test_malformed_entries_over_aligned_rings_read_the_nan_window(fused_on_cpu, monkeypatch):
    """ring.in_place as a captured step runs it (kernels/decode_entries stood in, the slots
    unchecked as a device tensor's are): a slot out of range and a repeated one read the
    rings' NaN window (StreamState.poison_row), so their rows are NaN with no mask after
    the pooling, and their slots go bad; the window stays NaN; the well-formed entry's row
    is the training row."""
    from kernel_standin import DecodeEntriesStandin
    from stream_driver import training_rows
    from csa_compressor.streaming import ring, steps

    made = []
    monkeypatch.setattr(steps, "_capturing", lambda t: True)
    monkeypatch.setattr(streaming.StreamState, "slot_index", lambda self, slots, name="": slots)
    monkeypatch.setattr(ring, "entries_launcher", lambda state, kv, score: made.append(
        DecodeEntriesStandin(state.ratio)) or made[-1].fn)
    g = torch.Generator().manual_seed(3)
    st = streaming.StreamState(4, 16, ratio=128, coff=1, dtype=torch.float32)
    assert st.aligned and st.poison_row == 5 * st.history
    prompt, ape = torch.randn(4 * 127, 16, generator=g), torch.randn(128, 16, generator=g)
    streaming.prefill(st, prompt, prompt, ape, [0, 127, 254, 381, 508], [0, 1, 2, 3])
    step = torch.randn(4, 1, 16, generator=g)
    out = streaming.decode(st, step, step, ape, torch.tensor([0, 1, 9, 1]))
    assert made and made[-1].calls == 1
    assert out.rows[1:].isnan().all() and not out.rows[0].isnan().any()
    assert bool(out.emitted[0, 0])  # slot 0's 128th token: its first window closes
    want = training_rows(torch.cat([prompt[:127], step[0]]), torch.cat([prompt[:127], step[0]]),
                         ape, [128], 128, 1, "fp32", None, None, True)
    assert torch.equal(out.rows[0, 0], want[0][0])
    assert st.bad.tolist() == [False, True, False, False, True]  # the spare's too
    for ring_t in st.flat_rings():
        assert ring_t.shape[0] == st.poison_row + 128
        assert ring_t[st.poison_row:].isnan().all() and not ring_t[:st.poison_row].isnan().any()


def test_the_torch_in_place_step_gives_bad_slots_the_nan_window(fused_on_cpu, monkeypatch):
    """steps._in_place (aligned rings in torch ops) as a captured step runs it: slots pushed
    past max_seqlen go bad and their rows are NaN (the rings' NaN window, as the entries
    kernel's), the other slot's row is not."""
    from csa_compressor.streaming import steps

    monkeypatch.setattr(steps, "_capturing", lambda t: True)
    taken = []
    torch_ops = steps._in_place
    monkeypatch.setattr(steps, "_in_place", lambda *a: taken.append(1) or torch_ops(*a))
    g = torch.Generator().manual_seed(4)
    st = streaming.StreamState(3, 16, ratio=128, coff=1, dtype=torch.float32, max_seqlen=130)
    prompt, ape = torch.randn(268, 16, generator=g), torch.randn(128, 16, generator=g)
    streaming.prefill(st, prompt, prompt, ape, [0, 129, 258, 268], [0, 1, 2])
    step = torch.randn(3, 2, 16, generator=g)
    out = streaming.decode(st, step, step, ape, [0, 1, 2])  # 131, 131, 12 tokens seen
    assert taken and st.bad[:3].tolist() == [True, True, False]
    assert out.rows[:2].isnan().all() and not out.rows[2].isnan().any()
    for ring_t in st.flat_rings():
        assert ring_t[st.poison_row:].isnan().all()


def test_the_kept_verdict_holds_only_for_the_ape_shape_it_checked(fused_on_cpu):
    """rows.fused_problem keeps the kernels' verdict a tensor layout: an APE of another
    row count after a good one is checked anew (the kernels read ``ratio`` of its rows),
    and the call then raises a clear error instead of reading past it."""
    from csa_compressor.streaming import rows

    st = streaming.StreamState(2, 16, ratio=4, coff=2, dtype=torch.float32)
    kv = torch.zeros(8, 32)
    assert rows.fused_problem(st, kv, kv, torch.zeros(4, 32)) is not None
    assert rows.fused_problem(st, kv, kv, torch.zeros(3, 32)) is None
    with pytest.raises(ValueError, match="ape"):
        streaming.prefill(st, kv, kv, torch.zeros(3, 32), [0, 8], [0])
