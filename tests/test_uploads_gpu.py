"""streaming/uploads.Staging on a GPU: staged copies arrive in stream order behind the
work queued before them, and a buffer whose copy is still queued is declined, not
overwritten, until the GPU has run it."""

import pytest
import torch

from csa_compressor.streaming.uploads import Staging, device_ints

pytestmark = pytest.mark.gpu


def test_staged_copies_wait_their_turn_and_their_buffers_are_not_reused_early():
    dev = torch.device("cuda")
    s = Staging(dev, buffers=2)
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
