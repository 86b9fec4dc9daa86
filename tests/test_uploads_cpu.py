"""streaming/uploads.Staging on the CPU (plain buffers and a stand-in event): the values
arrive in the dtype asked, the buffers are used in turn, and a buffer whose copy may
still be in flight, a list too large or an unsupported dtype is declined (the caller
then copies the unstaged way), never waited for or overwritten."""

import pytest
import torch

from csa_compressor.streaming.uploads import PinnedRing, Staging, device_ints


class Event:
    def __init__(self):
        self.done, self.records = True, 0

    def query(self):
        return self.done

    def record(self, stream):
        assert stream == "the device's stream"
        self.records += 1


def staging(**kw):
    return Staging(torch.device("cpu"), pinned=False, event=Event,
                   stream=lambda: "the device's stream", **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_values_arrive_in_the_dtype_asked(dtype):
    s = staging()
    vals = [0, 7, -3, 2**31 - 1, 5]
    got = s.upload(vals, dtype)
    assert got.dtype == dtype and got.tolist() == vals


def test_buffers_are_used_in_turn_and_each_copy_is_recorded():
    s = staging(buffers=2)
    a = s.upload([1, 2, 3], torch.int64)
    b = s.upload([4, 5], torch.int64)
    c = s.upload([6], torch.int64)  # the first buffer again, its copy done
    assert (a.tolist(), b.tolist(), c.tolist()) == ([1, 2, 3], [4, 5], [6])
    assert [e.records for e in s.events] == [2, 1]


def test_a_buffer_in_flight_is_declined_not_overwritten():
    s = staging(buffers=2)
    s.upload([1, 2], torch.int32)
    s.upload([3, 4], torch.int32)
    s.events[0].done = False  # its copy has not run yet
    before = s.bufs[0].clone()
    assert s.upload([9, 9], torch.int32) is None
    assert torch.equal(s.bufs[0], before)
    s.events[0].done = True
    assert s.upload([9, 9], torch.int32).tolist() == [9, 9]


def test_too_large_empty_or_other_dtypes_are_declined():
    s = staging(nbytes=16)
    assert s.upload(list(range(5)), torch.int32) is None  # 20 bytes
    assert s.upload(list(range(4)), torch.int32).tolist() == [0, 1, 2, 3]
    assert s.upload([], torch.int64) is None
    assert s.upload([1], torch.int16) is None


def test_off_cuda_device_ints_copies_plainly():
    s = staging()
    got = device_ints([3, 1], torch.device("cpu"), torch.int32, s)
    assert got.tolist() == [3, 1] and got.dtype == torch.int32
    assert all(e.records == 0 for e in s.events)  # staging is for CUDA copies only


def test_a_state_off_cuda_has_no_staging():
    from csa_compressor import streaming

    assert streaming.StreamState(2, 16, ratio=4, coff=2).staging() is None


class Runtime:
    """A stand-in for uploads.CudaRuntime: host copies, events that say done until told."""

    def __init__(self):
        self.is_current, self.stream_id, self.copies, self.destroyed = True, 1, 0, 0
        self.queries = 0

    def current(self):
        return self.is_current

    def stream(self):
        return self.stream_id

    def event(self):
        return {"done": True, "records": 0}

    def destroy(self, ev):
        self.destroyed += 1

    def record(self, ev, stream):
        ev["records"] += 1

    def done(self, ev):
        self.queries += 1
        return ev["done"]

    def copy(self, dst, src, nbytes, stream):
        import ctypes

        self.copies += 1
        ctypes.memmove(dst, src, nbytes)


def raw_staging(buffers=8, **kw):
    """A state's Staging through its own ring of ``buffers`` (a state's default: the
    device's shared one), both on one stand-in runtime."""
    raw = Runtime()
    ring = PinnedRing(raw, buffers=buffers, pinned=False, **kw)
    return Staging(torch.device("cpu"), buffers=buffers, raw=raw, ring=ring)


def test_raw_uploads_copy_and_record_through_the_runtime():
    s = raw_staging(buffers=2)
    a = s.upload([1, 2, 3], torch.int64)
    b = s.upload([4, 5], torch.int32)
    assert (a.tolist(), b.tolist(), a.dtype, b.dtype) == ([1, 2, 3], [4, 5], torch.int64, torch.int32)
    assert s.raw.copies == 2 and [e["records"] for e in s.ring.events] == [1, 1]
    s.ring.events[0]["done"] = False  # buffer 0's copy still queued: declined
    assert s.upload([6], torch.int64) is None
    s.raw.is_current = False  # another device is current: declined
    s.ring.events[0]["done"] = True
    assert s.upload([6], torch.int64) is None


def test_scratch_uploads_reuse_a_twin_on_its_stream_only():
    s = raw_staging(buffers=2)
    first = s.upload([1, 2], torch.int32, scratch=True)
    s.upload([3], torch.int32, scratch=True)
    again = s.upload([7, 8, 9], torch.int32, scratch=True)  # buffer 0 again, same stream
    assert again.data_ptr() == first.data_ptr() == s.twins[0].data_ptr()
    assert again.tolist() == [7, 8, 9]
    s.upload([4], torch.int32, scratch=True)
    s.raw.stream_id = 2  # another stream: the twin's readers may not have run
    other = s.upload([5, 6], torch.int32, scratch=True)
    assert other.data_ptr() != s.twins[0].data_ptr() and other.tolist() == [5, 6]
    plain = s.upload([1], torch.int32)  # not scratch: a fresh tensor
    assert plain.data_ptr() != s.twins[1].data_ptr()


def test_split_uploads_give_their_parts_and_scratch_ones_keep_their_views():
    """``shapes``: one upload as consecutive parts, every way (plain, raw, scratch, off
    CUDA); a scratch upload's parts are the twin's views, the same objects for the same
    buffer and split, so a call pays no slicing."""
    values, shapes = [0, 4, 8, 0, 1, 2, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24], \
        ((3,), (3,), (2, 5))
    want = [[0, 4, 8], [0, 1, 2], [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]]
    s = raw_staging(buffers=2)
    first = s.upload(values, torch.int32, scratch=True, shapes=shapes)
    assert [t.tolist() for t in first] == want
    assert first[0].data_ptr() == s.twins[0].data_ptr()
    s.upload([1], torch.int32, scratch=True)
    again = s.upload([v + 1 for v in values], torch.int32, scratch=True, shapes=shapes)
    assert all(a is b for a, b in zip(again, first))  # buffer 0 again: its kept views
    assert again[2].tolist() == [[v + 1 for v in row] for row in want[2]]
    plain_raw = s.upload(values, torch.int32, shapes=shapes)
    assert [t.tolist() for t in plain_raw] == want and plain_raw[0].data_ptr() != first[0].data_ptr()
    assert [t.tolist() for t in staging().upload(values, torch.int64, shapes=shapes)] == want
    off = device_ints(values, torch.device("cpu"), torch.int32, shapes=shapes)
    assert [t.tolist() for t in off] == want
    with pytest.raises(ValueError, match="shapes"):
        device_ints(values, torch.device("cpu"), torch.int32, shapes=((3,), (2, 5)))


def test_raw_events_are_destroyed_with_their_ring():
    import gc

    s = raw_staging(buffers=3)
    s.upload([1], torch.int32)
    raw = s.raw
    del s
    gc.collect()
    assert raw.destroyed == 3


def test_a_devices_states_share_one_ring_kept_for_the_process(monkeypatch):
    """Stagings made without a ring take their device's, made once: the runtime's copies
    read its pinned buffers unseen by torch's pinned allocator, so no state's end may free
    one while a copy from it is queued."""
    from csa_compressor.streaming import uploads

    monkeypatch.setattr(uploads, "_RINGS", {})
    dev = torch.device("cpu")
    a = Staging(dev, pinned=False, raw=Runtime())
    b = Staging(dev, pinned=False, raw=Runtime())
    assert a.ring is b.ring is uploads._RINGS[dev.index]
    assert a.upload([1, 2], torch.int32, scratch=True).tolist() == [1, 2]
    assert b.upload([3], torch.int32, scratch=True).tolist() == [3]
    assert a.ring.next == 2 and a.twins[0].data_ptr() != b.twins[0].data_ptr()


def test_raw_events_guard_rounds_of_half_the_buffers():
    """One event a round of buffers // 2 copies on one stream (and at a change of stream),
    one query for a round's buffers: a buffer of a round whose event is not done is
    declined, and once it is done the whole round is free."""
    s = raw_staging(buffers=8)
    for i in range(3):
        s.upload([i], torch.int64)
    assert [e["records"] for e in s.ring.events] == [0] * 8  # the round is open
    s.upload([3], torch.int64)
    assert [e["records"] for e in s.ring.events] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert s.ring.guard == [3, 3, 3, 3, None, None, None, None]
    s.upload([4], torch.int64)
    s.raw.stream_id = 2  # a copy on another stream closes the round on the first
    s.upload([5], torch.int64)
    assert s.ring.events[4]["records"] == 1 and s.ring.guard[4] == 4 and s.ring.guard[5] is None
    s.upload([6], torch.int64)
    s.upload([7], torch.int64)
    s.ring.events[3]["done"] = False  # the first round's copies still queued: buffer 0 declined
    queries = s.raw.queries
    assert s.upload([8], torch.int64) is None
    s.ring.events[3]["done"] = True
    assert s.upload([8], torch.int64).tolist() == [8]  # the round is 5, 6, 7 and 0 on stream 2
    assert s.ring.events[0]["records"] == 1 and s.ring.guard == [0, None, None, None, 4, 0, 0, 0]
    assert s.upload([9], torch.int64).tolist() == [9]  # buffer 1: freed with its round
    assert s.raw.queries == queries + 2 and s.raw.copies == 10


def test_states_on_threads_share_a_ring_without_mixing_their_values():
    """Stagings of two states on two threads copy through one ring: each upload sees its
    own values (the ring's lock keeps a buffer from being filled by one thread and copied
    by another)."""
    import threading

    raw = Runtime()
    ring = PinnedRing(raw, buffers=4, pinned=False)
    bad = []

    def work(base):
        s = Staging(torch.device("cpu"), buffers=4, raw=Runtime(), ring=ring)
        for i in range(3000):
            want = [base + i] * 64
            got = s.upload(want, torch.int64)
            if got is not None and got.tolist() != want:
                bad.append((base, i))

    threads = [threading.Thread(target=work, args=(b,)) for b in (0, 10**6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and raw.copies == 6000


def test_scratch_hands_out_the_twins_in_turn_on_their_stream_only():
    """Staging.scratch (values a kernel writes): the twins' kept views, in the same turn
    as scratch uploads; declined (None, never a fresh tensor the caller would not expect)
    on another stream, another device, or past a twin's bytes."""
    s = raw_staging(buffers=2)
    shapes = ((3,), (3,), (2, 5))
    flat, parts = s.scratch(torch.int32, 16, shapes)
    assert flat.shape == (16,) and flat.data_ptr() == s.twins[0].data_ptr()
    assert [tuple(p.shape) for p in parts] == [(3,), (3,), (2, 5)]
    assert parts[2].data_ptr() == flat.data_ptr() + 6 * 4
    up = s.upload([1], torch.int32, scratch=True)  # twin 1: the turn is shared
    assert up.data_ptr() == s.twins[1].data_ptr()
    again = s.scratch(torch.int32, 16, shapes)
    assert again[0] is flat and all(a is b for a, b in zip(again[1], parts))
    s.raw.stream_id = 2  # twin 1's last reader is on stream 1
    assert s.scratch(torch.int32, 16, shapes) is None
    s.raw.stream_id = 1
    assert s.scratch(torch.int32, s.nbytes // 4 + 1, ((s.nbytes // 4 + 1,),)) is None
    s.raw.is_current = False
    assert s.scratch(torch.int32, 16, shapes) is None
    assert staging().scratch(torch.int32, 4, ((4,),)) is None  # no runtime: no twins
