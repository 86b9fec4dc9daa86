"""streaming/uploads.Staging on a GPU: staged copies arrive in stream order behind the
work queued before them, and a buffer whose copy is still queued is declined, not
overwritten, until the GPU has run it."""

import pytest
import torch

from csa_compressor.streaming.uploads import CudaRuntime, PinnedRing, Staging, device_ints


def _raw(dev, buffers):
    """A Staging through its own ring of ``buffers`` (a state's takes the device's)."""
    rt = CudaRuntime.make(dev)
    return Staging(dev, buffers=buffers, raw=rt, ring=PinnedRing(rt, buffers=buffers))

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("raw", [False, True])
def test_staged_copies_wait_their_turn_and_their_buffers_are_not_reused_early(raw):
    """Both ways: torch's copy_ and events, and cuda-python's (uploads.CudaRuntime)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if raw:
        assert CudaRuntime.make(dev) is not None
    s = _raw(dev, 2) if raw else Staging(dev, buffers=2)
    # a process's first allocation, copy and event record cost milliseconds of host time:
    # made before the GPU is kept busy, so that the copies below are still queued when checked
    for _ in range(2):
        s.upload([0], torch.int32)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # some 100 ms of GPU time ahead of the copies
    a = s.upload([1, 2, 3], torch.int32)
    b = s.upload([4, 2**40], torch.int64)
    assert s.upload([6], torch.int32) is None  # buffer 0's copy still queued
    c = device_ints([6], dev, torch.int32, s)  # the unstaged way instead
    torch.cuda.synchronize()
    assert (a.tolist(), b.tolist(), c.tolist()) == ([1, 2, 3], [4, 2**40], [6])
    assert a.dtype == torch.int32 and b.dtype == torch.int64
    assert s.upload([7, 8], torch.int32).tolist() == [7, 8]  # its copy has run


def test_scratch_uploads_reuse_the_twins_in_stream_order_and_not_across_streams():
    """Scratch uploads (uploads.CudaRuntime) land in the state's device twins: each
    read by a kernel queued after it sees its own values although the twins are reused,
    and a scratch upload on another stream than the twin's last takes a fresh tensor."""
    dev = torch.device("cuda", torch.cuda.current_device())
    s = _raw(dev, 2)
    seen, twins = [], set()
    for i in range(12):
        t = device_ints([i, 2 * i, 3 * i], dev, torch.int32, s, scratch=True)
        twins.add(t.data_ptr())
        seen.append(t * 1)  # a reader queued behind the copy, before the twin's next one
        if i % 4 == 0:
            torch.cuda._sleep(2_000_000)  # keep some copies queued behind GPU work
    torch.cuda.synchronize()
    assert [x.tolist() for x in seen] == [[i, 2 * i, 3 * i] for i in range(12)]
    assert {s.twins[k].data_ptr() for k in range(2)} <= twins
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        t = s.upload([5, 6], torch.int32, scratch=True)
        assert t.data_ptr() not in {s.twins[k].data_ptr() for k in range(2)}
        got = t * 1
    torch.cuda.synchronize()
    assert got.tolist() == [5, 6]


def test_a_round_of_copies_guards_its_buffers_until_its_event_has_run():
    """With four buffers (rounds of two copies, one event each), a buffer whose round is
    still queued behind GPU work is declined, and every staged copy arrives."""
    dev = torch.device("cuda", torch.cuda.current_device())
    s = _raw(dev, 4)
    for _ in range(4):
        s.upload([0], torch.int32)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # some 100 ms of GPU time ahead of the copies
    got = [s.upload([i, -i], torch.int32) for i in range(4)]
    assert s.upload([9], torch.int32) is None  # buffer 0's round still queued
    torch.cuda.synchronize()
    assert [t.tolist() for t in got] == [[i, -i] for i in range(4)]
    assert s.upload([9], torch.int32).tolist() == [9]
    assert s.upload([10], torch.int32).tolist() == [10]  # freed with buffer 0's round
