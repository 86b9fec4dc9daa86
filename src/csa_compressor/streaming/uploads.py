"""Small host integer lists onto the GPU in stream order, with no host sync.

torch's copy from pageable memory synchronises the stream, so a prefill's index lists go
through pinned memory. A fresh pinned tensor a list (as_tensor, pin_memory, to) cost some
80 µs of host time a call on the H100 host, most of a prefill's budget; ``Staging`` keeps
a few pinned buffers per stream state and reuses one once the copy that read it has run.
"""

from __future__ import annotations

import array
import ctypes

import torch

# array typecodes of the index dtypes ("i" and "q" are 4 and 8 bytes on the hosts torch runs on)
_CODES = {torch.int32: "i", torch.int64: "q"}


def device_ints(values, device, dtype=torch.int64, staging=None) -> torch.Tensor:
    """``values`` (a host list) as a tensor on ``device`` without a host sync: a CUDA copy
    from pinned memory in stream order, through ``staging`` (a Staging) where it has a free
    buffer. Under CUDA-graph capture the copy is a plain one (a captured copy from a reused
    buffer would read what the buffer holds at replay)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.as_tensor(values, dtype=dtype).to(device)
    if staging is not None:
        got = staging.upload(values, dtype)
        if got is not None:
            return got
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Staging:
    """``buffers`` pinned host buffers of ``nbytes`` each, used in turn; each is reused only
    once the event recorded after the copy that read it has completed (never a wait: a
    buffer still in flight sends the list the unstaged way). ``pinned``, ``event`` and
    ``stream`` are seams for the CPU tests (a CUDA build pins, and records CUDA events on
    the device's current stream, where the copy runs, whichever device is current)."""

    def __init__(self, device, *, buffers: int = 8, nbytes: int = 1 << 15, pinned: bool = True,
                 event=None, stream=None):
        self.device, self.nbytes = device, nbytes
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
                     for _ in range(buffers)]
        self.events = [(event or torch.cuda.Event)() for _ in range(buffers)]
        self.stream = stream or (lambda: torch.cuda.current_stream(device))
        self.next = 0

    def upload(self, values, dtype) -> torch.Tensor | None:
        """``values`` on the device, or None where no buffer is free or large enough."""
        code = _CODES.get(dtype)
        if code is None:
            return None
        arr = array.array(code, values)
        n = arr.itemsize * len(arr)
        k = self.next
        if not arr or n > self.nbytes or not self.events[k].query():
            return None
        buf = self.bufs[k]
        ctypes.memmove(buf.data_ptr(), arr.buffer_info()[0], n)
        out = torch.empty(len(arr), dtype=dtype, device=self.device)
        out.copy_(buf[:n].view(dtype), non_blocking=True)
        self.events[k].record(self.stream())
        self.next = (k + 1) % len(self.bufs)
        return out
