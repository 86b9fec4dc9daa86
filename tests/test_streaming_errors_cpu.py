"""csa_compressor.streaming's bad input (plain-torch path, CPU): every malformed call is an
error naming the argument, made before anything writes to the state; a state_dict whose
counts no stream could have does not load; a slot gone bad stays an error until reset."""

import pytest
import torch

from csa_compressor import streaming


def _state():
    return streaming.StreamState(2, 16, ratio=4, coff=2, dtype=torch.float32, max_next_n=2,
                                 max_seqlen=24)


@pytest.mark.parametrize("call,match", [
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 8], [2]), "slots: slot 2"),
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 4, 8], [1, 1]), "more than once"),
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 9], [0]), "cu_seqlens: the last"),
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 5, 3], [0, 1]), "non-decreasing"),
    (lambda st, kv, ape: streaming.prefill(st, kv.half(), kv.half(), ape, [0, 8], [0]), "dtype"),
    (lambda st, kv, ape: streaming.prefill(st, kv[:, :16], kv[:, :16], ape, [0, 8], [0]),
     r"coff\*head_dim = 32"),
    (lambda st, kv, ape: streaming.decode(st, kv[:6].view(2, 3, 32), kv[:6].view(2, 3, 32), ape),
     "next_n"),
    (lambda st, kv, ape: streaming.decode(st, kv[:2].view(1, 2, 32), kv[:2].view(1, 2, 32), ape,
                                          [-1]), "out of range"),
    (lambda st, kv, ape: streaming.take_back(st, 1), "k: 1 tokens"),
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 8], [0], numerics="bf16"),
     "numerics"),
    # torch.tensor would round 4.5 to 4: offsets are ints or an error
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 4.5, 8], [0, 1]),
     "cu_seqlens: expected integer offsets"),
    (lambda st, kv, ape: streaming.prefill(object(), kv, kv, ape, [0, 8], [0]), "state: expected"),
    (lambda st, kv, ape: streaming.decode({}, kv[:2].view(1, 2, 32), kv[:2].view(1, 2, 32), ape),
     "state: expected"),
    (lambda st, kv, ape: streaming.take_back(st, -1), "k: expected 0 or more tokens, got -1"),
    (lambda st, kv, ape: streaming.take_back(st, 1.0), "k: expected an int or an integer tensor"),
    (lambda st, kv, ape: st.reorder([1, 2]), "index: slot 2 at index 1 is out of range"),
    (lambda st, kv, ape: st.reorder(torch.tensor([-1, 0])), "index: slot -1 at index 0"),
    (lambda st, kv, ape: st.reorder([0.0, 1]), "index: expected slot indices as ints"),
    (lambda st, kv, ape: streaming.prefill(st, kv, kv, ape, [0, 8], [0], emit="no"),
     "emit: expected True or False"),
    (lambda st, kv, ape: streaming.StreamState(2, 16, ratio=4, coff=2, device="nodev"),
     "device: expected a torch.device"),
])
def test_malformed_input_is_an_error(call, match):
    st = _state()
    kv, ape = torch.randn(8, 32), torch.randn(4, 32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(st, kv, ape)


def test_capacity_and_take_back_bounds():
    st = _state()
    kv, ape = torch.randn(24, 32), torch.randn(4, 32)
    streaming.prefill(st, kv[:23], kv[:23], ape, [0, 23], [0])
    with pytest.raises(ValueError, match="capacity of 24"):
        streaming.decode(st, kv[:4].view(2, 2, 32), kv[:4].view(2, 2, 32), ape)
    streaming.decode(st, kv[:2].view(2, 1, 32), kv[:2].view(2, 1, 32), ape)
    streaming.take_back(st, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="more than the 0"):
        streaming.take_back(st, 1, [0])
    assert st.count[:2].tolist() == [23, 1]
    with pytest.raises(ValueError, match="past its capacity"):
        streaming.prefill(st, kv[:2], kv[:2], ape, [0, 2], [0])


@pytest.mark.parametrize("key,value,match", [
    ("count", -5, r"state_dict\['count'\]: slot 0 has seen -5 tokens"),
    ("count", 25, r"seen 25 tokens, expected 0 to 24"),  # past max_seqlen
    ("last_n", 3, r"state_dict\['last_n'\]: slot 0 took 3 tokens"),  # past max_next_n
    ("last_n", -1, r"took -1 tokens"),
])
def test_load_state_dict_checks_the_counts(key, value, match):
    """Decode and prefill index the rings and place rows by the counts: a state_dict whose
    counts no stream could have is an error, and the state is left as it was."""
    st = _state()
    kv, ape = torch.randn(8, 32), torch.randn(4, 32)
    streaming.prefill(st, kv, kv, ape, [0, 6, 8], [0, 1])
    saved = st.state_dict()
    saved[key][0] = value
    fresh = _state()
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(saved)
    assert fresh.count.tolist() == [0, 0, 0]
    saved[key][0] = 2 if key == "last_n" else 6  # last_n 2 is at most its count of 6
    fresh.load_state_dict(saved)
    assert fresh.count[:2].tolist() == [6, 2]
    with pytest.raises(TypeError, match="sd: expected a dict"):
        fresh.load_state_dict([("count", 1)])


def test_a_loaded_bad_slot_is_an_error_until_reset():
    """A state saved with a slot gone bad (NaN rows) loads, and prefill and decode on that
    slot raise until it is reset; the other slot goes on."""
    st = _state()
    kv, ape = torch.randn(8, 32), torch.randn(4, 32)
    saved = st.state_dict()
    saved["bad"][1] = True
    st.load_state_dict(saved)
    streaming.prefill(st, kv[:4], kv[:4], ape, [0, 4], [0])
    with pytest.raises(ValueError, match="slots: slot 1 met malformed input"):
        streaming.prefill(st, kv[:4], kv[:4], ape, [0, 4], [1])
    with pytest.raises(ValueError, match="slots: a slot met malformed input"):
        streaming.decode(st, kv[:2].view(1, 2, 32), kv[:2].view(1, 2, 32), ape, [1])
    st.reset([1])
    assert streaming.prefill(st, kv[:4], kv[:4], ape, [0, 4], [1]).rows.shape[0] == 1


def test_decode_checks_with_and_without_the_host_record():
    """The capacity check on the host's counts (host slots) and on the device's (after
    load_state_dict the host keeps none): the same error either way."""
    kv, ape = torch.randn(24, 32), torch.randn(4, 32)
    for fresh in (False, True):
        st = _state()
        streaming.prefill(st, kv[:23], kv[:23], ape, [0, 23], [1])
        if fresh:
            other = _state()
            other.load_state_dict(st.state_dict())
            st = other
            assert st.host_counts is None
        with pytest.raises(ValueError, match="index 1 past its capacity"):
            streaming.decode(st, kv[:4].view(2, 2, 32), kv[:4].view(2, 2, 32), ape, [0, 1])
