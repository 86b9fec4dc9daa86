"""Small host integer lists onto the GPU in stream order, with no host sync.

torch's copy from pageable memory synchronises the stream, so a prefill's index lists go
through pinned memory. A fresh pinned tensor a list (as_tensor, pin_memory, to) cost some
80 µs of host time a call on the H100 host, most of a prefill's budget; a stream state's
``Staging`` copies through a few pinned buffers its device's states share (PinnedRing),
each reused once the copy that read it has run.
"""

from __future__ import annotations

import array
import ctypes
import math
import threading
import weakref

import torch

# array typecodes of the index dtypes ("i" and "q" are 4 and 8 bytes on the hosts torch runs on)
_CODES = {torch.int32: "i", torch.int64: "q"}
# the device twins' views kept at most (a key a twin, dtype, count and split)
_VIEWS_KEPT = 512


def device_ints(values, device, dtype=torch.int64, staging=None, scratch: bool = False,
                shapes: tuple | None = None):
    """``values`` (a host list) as a tensor on ``device`` without a host sync: a CUDA copy
    from pinned memory in stream order, through ``staging`` (a Staging) where it has a free
    buffer. Under CUDA-graph capture the copy is a plain one (a captured copy from a reused
    buffer would read what the buffer holds at replay). ``scratch``: the caller's launches
    in this call are the result's only readers (Staging.upload). ``shapes``: the values as
    consecutive parts of these shapes, a tuple of tensors (one upload for several lists)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return split(torch.as_tensor(values, dtype=dtype).to(device), shapes)
    if staging is not None:
        got = staging.upload(values, dtype, scratch, shapes)
        if got is not None:
            return got
    return split(torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True),
                 shapes)


def split(t: torch.Tensor, shapes: tuple | None):
    """1-D ``t`` as consecutive parts of ``shapes`` (a tuple of views), or ``t`` where
    ``shapes`` is None."""
    if shapes is None:
        return t
    parts, i = [], 0
    for shape in shapes:
        n = math.prod(shape)
        parts.append(t[i:i + n].view(shape))
        i += n
    if i != t.shape[0]:
        raise ValueError(f"shapes: {shapes} hold {i} values, not the {t.shape[0]} uploaded")
    return tuple(parts)


class CudaRuntime:
    """The CUDA runtime calls a staged upload makes, through cuda-python (which comes with
    the CuTe DSL), on ``device`` while it is the current device: a copy, an event record
    and an event query of 0.3-2 µs of host time each, where torch's ``copy_`` (a tensor
    iterator, an event on the pinned block), ``current_stream`` and ``Event.record`` cost
    several times that (tools/host_pieces_probe.py). ``make`` gives None without
    cuda-python."""

    @classmethod
    def make(cls, device):
        try:
            from cuda.bindings import runtime
        except ImportError:
            return None
        return cls(device, runtime)

    def __init__(self, device, rt):
        self.rt, self.index = rt, device.index or 0
        # with one visible GPU (they do not change once CUDA is up) it is always current
        self.only_gpu = torch.cuda.device_count() == 1
        self.ok, self.not_ready = rt.cudaError_t.cudaSuccess, rt.cudaError_t.cudaErrorNotReady
        self.h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    def current(self) -> bool:
        return self.only_gpu or torch.cuda.current_device() == self.index

    def stream(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self.index)

    def _check(self, what, err) -> None:
        if err != self.ok:
            raise RuntimeError(f"{what} on cuda:{self.index}: {err}")

    def event(self):
        err, ev = self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming)
        self._check("cudaEventCreateWithFlags", err)
        return ev

    def destroy(self, ev) -> None:
        self.rt.cudaEventDestroy(ev)

    def record(self, ev, stream: int) -> None:
        self._check("cudaEventRecord", self.rt.cudaEventRecord(ev, stream)[0])

    def done(self, ev) -> bool:
        err = self.rt.cudaEventQuery(ev)[0]
        if err == self.not_ready:
            return False
        self._check("cudaEventQuery", err)
        return True

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst, src, nbytes, self.h2d, stream)[0])


class PinnedRing:
    """``buffers`` pinned host buffers of ``nbytes`` that the runtime's copies read (``raw``,
    a CudaRuntime or a stand-in), used in turn under a lock; a buffer is reused only once
    an event recorded after its copy has completed (never a wait: a buffer in flight
    declines). One event a round of ``buffers // 2`` copies on one stream, not one a copy:
    a record and a query cost some 5 µs of a prefill's host time on the H100 host.

    A device's stream states share one, kept for the process (shared_ring): torch's pinned
    allocator does not see these copies, so a buffer freed with its state could be handed
    to another pinned tensor while a copy from it is still queued."""

    def __init__(self, raw, *, buffers: int = 8, nbytes: int = 1 << 15, pinned: bool = True):
        self.raw, self.nbytes = raw, nbytes
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
                     for _ in range(buffers)]
        self.ptrs = [b.data_ptr() for b in self.bufs]
        self.events = None  # the runtime's, made on the device at the first copy
        self.next = 0
        # ``guard[k]``: the event recorded after buffer k's last copy (None: free, or in
        # the open round)
        self.round, self.round_stream, self.round_len = [], None, max(1, buffers // 2)
        self.guard = [None] * buffers
        self.lock = threading.Lock()

    def copy(self, arr, n: int, dst: int, stream: int) -> bool:
        """Queue a copy of ``arr``'s first ``n`` bytes to device address ``dst`` on
        ``stream`` through the next buffer; False (nothing done) where it is in flight."""
        raw = self.raw
        with self.lock:
            if self.events is None:
                self.events = [raw.event() for _ in self.bufs]
                weakref.finalize(self, _destroy, raw, list(self.events))
            k = self.next
            g = self.guard[k]
            if g is not None:
                if not raw.done(self.events[g]):
                    return False
                self.guard = [None if h == g else h for h in self.guard]  # its round is free
            if self.round and stream != self.round_stream:
                self._close_round()  # an event covers the copies of one stream
            ctypes.memmove(self.ptrs[k], arr.buffer_info()[0], n)
            raw.copy(dst, self.ptrs[k], n, stream)
            self.round.append(k)
            self.round_stream = stream
            if len(self.round) >= self.round_len:
                self._close_round()
            self.next = (k + 1) % len(self.bufs)
            return True

    def _close_round(self) -> None:
        """An event after the open round's copies, guarding each of its buffers. The ring
        returns to a buffer only after more copies than a round holds, so no buffer is
        reused while its round is open."""
        e = self.round[-1]
        self.raw.record(self.events[e], self.round_stream)
        for j in self.round:
            self.guard[j] = e
        self.round = []


# device index -> the PinnedRing its stream states share, never freed (PinnedRing)
_RINGS: dict = {}
_RINGS_LOCK = threading.Lock()


def shared_ring(device, raw, pinned: bool = True) -> PinnedRing:
    """``device``'s PinnedRing, made at first use with ``raw`` (``pinned``: as PinnedRing's,
    a seam for the CPU tests)."""
    got = _RINGS.get(device.index)
    if got is None:
        with _RINGS_LOCK:
            got = _RINGS.get(device.index)
            if got is None:
                got = _RINGS[device.index] = PinnedRing(raw, pinned=pinned)
    return got


class Staging:
    """A stream state's uploads. Without ``raw``: ``buffers`` pinned host buffers of
    ``nbytes`` each, used in turn, each reused only once the torch event recorded after
    its copy has completed (never a wait: a buffer still in flight sends the list the
    unstaged way); ``pinned``, ``event`` and ``stream`` are seams for the CPU tests (a
    CUDA build pins, and records CUDA events on the device's current stream, where the
    copy runs, whichever device is current).

    ``raw`` (a CudaRuntime, or a stand-in with its methods): copies through ``ring`` (a
    PinnedRing; the device's shared one by default) while ``device`` is the current
    device (else the list goes the unstaged way). Its ``scratch`` uploads land in one of
    ``buffers`` device twins of the state's own, used in turn, with no allocation: a
    twin's next copy is queued behind this call's readers on the same stream (a
    different stream takes a fresh tensor), so a scratch result must not outlive its call.
    """

    def __init__(self, device, *, buffers: int = 8, nbytes: int = 1 << 15, pinned: bool = True,
                 event=None, stream=None, raw=None, ring=None):
        self.device, self.nbytes, self.raw = device, nbytes, raw
        self.next = 0
        if raw is None:
            self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
                         for _ in range(buffers)]
            self.events = [(event or torch.cuda.Event)() for _ in range(buffers)]
            self.stream = stream or (lambda: torch.cuda.current_stream(device))
            return
        self.ring = ring or shared_ring(device, raw, pinned)
        self.nbytes = self.ring.nbytes
        self.twins, self.twin_streams, self.views = {}, [None] * buffers, {}

    def upload(self, values, dtype, scratch: bool = False, shapes: tuple | None = None):
        """``values`` on the device (as device_ints' ``shapes``), or None where no buffer is
        free or large enough."""
        code = _CODES.get(dtype)
        if code is None:
            return None
        arr = array.array(code, values)
        n = arr.itemsize * len(arr)
        if not arr or n > self.nbytes:
            return None
        if self.raw is not None:
            return self._raw_upload(arr, n, dtype, scratch, shapes)
        k = self.next
        if not self.events[k].query():
            return None
        buf = self.bufs[k]
        ctypes.memmove(buf.data_ptr(), arr.buffer_info()[0], n)
        out = torch.empty(len(arr), dtype=dtype, device=self.device)
        out.copy_(buf[:n].view(dtype), non_blocking=True)
        self.events[k].record(self.stream())
        self.next = (k + 1) % len(self.bufs)
        return split(out, shapes)

    def _raw_upload(self, arr, n: int, dtype, scratch: bool, shapes):
        raw = self.raw
        if not raw.current():
            return None
        stream = raw.stream()
        twin = self._take_twin(stream, dtype, len(arr), shapes) if scratch else None
        if twin is not None:
            flat, got = twin
        else:
            flat = torch.empty(len(arr), dtype=dtype, device=self.device)
            got = split(flat, shapes)
        return got if self.ring.copy(arr, n, flat.data_ptr(), stream) else None

    def scratch(self, dtype, count: int, shapes: tuple):
        """A scratch twin for values the caller writes on the device itself (a kernel
        launched on the current stream) rather than copies: ``(flat, parts)``, its first
        ``count`` values as ``dtype`` and those split as ``shapes``; as a scratch upload's
        result it must not outlive the call. None where the twins are not this state's to
        hand out now (no runtime, another device current, the next twin's last use on
        another stream, more bytes than a twin holds)."""
        raw = self.raw
        if raw is None or not raw.current() or count * dtype.itemsize > self.nbytes:
            return None
        return self._take_twin(raw.stream(), dtype, count, shapes)

    def _take_twin(self, stream: int, dtype, count: int, shapes):
        """The next twin's ``(flat, parts)`` (_twin_parts), its turn taken for ``stream``,
        or None where its last use was on another stream (its readers there may not have
        run). A turn taken by an upload whose copy then declines stays taken: the twin was
        not written, and its stream is still its last reader's."""
        j = self.next
        if self.twin_streams[j] not in (None, stream):
            return None
        self.twin_streams[j] = stream
        self.next = (j + 1) % len(self.twin_streams)
        return self._twin_parts(j, dtype, count, shapes)

    def _twin_parts(self, k: int, dtype, count: int, shapes):
        """``(flat, parts)``: the first ``count`` values of twin ``k`` as ``dtype``, and
        those split as ``shapes``: views made once a key and kept (a slice or view costs
        2 µs of host time on the H100 host), up to _VIEWS_KEPT keys."""
        key = (k, dtype, count, shapes)
        got = self.views.get(key)
        if got is None:
            whole = self.twins.get(k)
            if whole is None:
                whole = self.twins[k] = torch.empty(self.nbytes, dtype=torch.uint8,
                                                    device=self.device)
            if len(self.views) >= _VIEWS_KEPT:
                self.views.clear()
            flat = whole.view(dtype)[:count]
            got = self.views[key] = (flat, split(flat, shapes))
        return got


def _destroy(raw, events) -> None:
    for ev in events:
        raw.destroy(ev)
