"""The per-slot streaming state: the last tokens' raw ``kv`` / ``score`` and the counts.

Each slot keeps a ring of its last ``history = coff*ratio + max_next_n`` tokens: what the
next rows need (the unfinished block and, at coff 2, the block before it) plus the tokens
a decode step may take back. Long windows at coff 1 (ratio > ALIGNED_MIN_RATIO) keep
``ratio`` tokens (``max_next_n`` 1) or ``2 * ratio``: every window then lies whole in its
ring, and decode pools it there (steps.py). One spare slot past the last takes the writes
of entries a captured step rejects, so a bad index never lands in a caller's slot.
"""

from __future__ import annotations

import torch

from ..checks import SUPPORTED_DTYPES, check_int, check_ratio_coff, check_tensor
from .uploads import CudaRuntime, Staging, device_ints

# coff-1 windows longer than this many tokens (the long-window kernels' windows at the
# default tuning) keep aligned rings (history)
ALIGNED_MIN_RATIO = 16

_CONFIG = ("num_slots", "head_dim", "ratio", "coff", "max_next_n", "max_seqlen")
_TENSORS = ("kv", "score", "count", "last_n", "bad")


class StreamState:
    """What ``num_slots`` sequences being generated need for their next compressed rows.

    ``kv`` / ``score`` ``(num_slots + 1, history, coff*head_dim)`` in the input dtype (token
    ``t`` of slot ``s`` at ``[s, t % history]``; flat_rings adds the aligned rings' NaN
    window, ``poison_row``), ``count`` the tokens seen, ``last_n`` the
    tokens of the slot's last decode step (what take_back may return), ``bad`` set where a
    captured step or a device reorder met malformed input for the slot (its rows are NaN
    until reset).
    ``max_seqlen``: the most tokens a slot may see (None: int32 positions).
    """

    def __init__(self, num_slots: int, head_dim: int, *, ratio: int, coff: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_next_n: int = 4,
                 max_seqlen: int | None = None):
        check_int("num_slots", num_slots, 1)
        check_int("head_dim", head_dim, 1)
        check_ratio_coff(ratio, coff)
        check_int("max_next_n", max_next_n, 1)
        if max_seqlen is not None:
            check_int("max_seqlen", max_seqlen, 1, 2**31 - 1)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {dtype!r}")
        self.num_slots, self.head_dim, self.ratio, self.coff = num_slots, head_dim, ratio, coff
        self.max_next_n, self.max_seqlen, self.dtype = max_next_n, max_seqlen, dtype
        try:
            self.device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch.device or its name, got {device!r}") from exc
        # aligned: every window lies whole in its ring, and a step closes one at most
        self.history, self.aligned = history(ratio, coff, max_next_n)
        shape = (num_slots + 1, self.history, coff * head_dim)
        rows = shape[0] * self.history
        # Aligned rings end in one window of NaN tokens that nothing writes: a malformed
        # decode entry pools it, so its row is NaN with no mask after the pooling.
        self.poison_row = rows if self.aligned else None
        flat = [torch.zeros((rows + (ratio if self.aligned else 0), shape[2]), dtype=dtype,
                            device=self.device) for _ in range(2)]
        for t in flat:
            t[rows:] = float("nan")
        self._flat = tuple(flat)
        self.kv, self.score = (t[:rows].view(shape) for t in flat)
        self.device = self.kv.device  # "cuda" resolved to "cuda:0", as the caller's tensors say it
        self.device_index = self.kv.get_device()  # -1 off CUDA
        self.count = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self.last_n = torch.zeros_like(self.count)
        self.bad = torch.zeros(num_slots + 1, dtype=torch.bool, device=self.device)
        # shape-only tensors: decode's by (batch, next_n, epilogue), the fused path's probe
        # (rows._probe), the ring's zero APE; the host lists' uploads (staging)
        self.constants: dict = {}
        # The counts as the host knows them, while every change went through calls that
        # saw their slots on the host: prefill then reads nothing from the device. A
        # captured step may replay unseen, so after a capture the device's are read.
        self.host_counts: list | None = [0] * num_slots
        self.captured = False

    def staging(self):
        """How this state's host lists go to its GPU (uploads.Staging: its device's shared
        pinned buffers and the state's own device twins; made at first use; None off
        CUDA)."""
        if self.device.type != "cuda":
            return None
        got = self.constants.get("staging")
        if got is None:
            got = self.constants["staging"] = Staging(self.device,
                                                      raw=CudaRuntime.make(self.device))
        return got

    def flat_rings(self) -> tuple:
        """``(kv, score)`` rings as ``(slots * history, width)`` tensors (the rings' own
        storage), then for aligned rings the ``ratio`` NaN tokens at ``poison_row``."""
        return self._flat

    @property
    def width(self) -> int:
        return self.coff * self.head_dim

    @property
    def spare(self) -> int:
        """The index of the slot that takes rejected writes."""
        return self.num_slots

    @property
    def position_limit(self) -> int:
        return 2**31 - 1 if self.max_seqlen is None else self.max_seqlen

    def reset(self, slots=None) -> None:
        """Empty ``slots`` (all where None) for new sequences; in place, capture-safe with
        ``slots`` None or on the device."""
        if slots is None:
            for t in (self.count, self.last_n, self.bad):
                t.zero_()
        else:
            # index_fill_, not t[idx] = 0: that copies the number to the device, a sync
            idx = self.slot_index(slots, "slots")
            for t in (self.count, self.last_n, self.bad):
                t.index_fill_(0, idx, 0)
        self.follow(which(slots), lambda c: 0, self.capturing())

    def reorder(self, index) -> None:
        """Slot ``i`` takes what slot ``index[i]`` held (beam search's reorder), in place.
        Indices out of ``[0, num_slots)``: an error where ``index`` lives on the host; on
        the GPU (read nowhere: no sync, capturable) their slots go bad instead."""
        order = self.host_slots(index, "index", unique=False)  # a slot may go to several
        idx = torch.as_tensor(index if order is None else order, dtype=torch.int64,
                              device=self.device)
        if idx.numel() != self.num_slots:
            raise ValueError(f"index: expected {self.num_slots} slot indices, got shape {tuple(idx.shape)}")
        if order is None:
            # checked on the device, no sync: a negative index would read another slot
            # (torch wraps it), a large one is a device-side assert; such a slot takes the
            # spare's and goes bad (NaN rows, an error at its next eager decode or prefill)
            inside = (idx >= 0) & (idx < self.num_slots)
            idx = torch.where(inside, idx, torch.full_like(idx, self.spare))
        for t in (self.kv, self.score, self.count, self.last_n, self.bad):
            t[: self.num_slots] = t[idx]
        if order is None:
            self.bad[: self.num_slots] |= ~inside
        if order is None or self.host_counts is None:
            self.host_counts = None
        else:
            self.host_counts = [self.host_counts[i] for i in order]

    def capturing(self) -> bool:
        return torch.compiler.is_compiling() or (
            self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def follow(self, slots, change, capturing: bool = False) -> None:
        """Keep the host's counts in step with a change to ``slots`` (a host list; None:
        every slot) made by ``change(count)``; a change the host cannot see (``slots``
        ``False``, or a capture) ends them."""
        if capturing:
            self.captured = True
        if capturing or slots is False or self.host_counts is None:
            self.host_counts = None
            return
        for s in (range(self.num_slots) if slots is None else slots):
            self.host_counts[s] = change(self.host_counts[s])

    def set_host_counts(self, slots: list, counts: list) -> None:
        """The host's record of ``slots``' counts, where it keeps one, after a prefill set
        them on the device."""
        if self.host_counts is not None:
            for s, c in zip(slots, counts):
                self.host_counts[s] = c

    def counts_of(self, slots: list) -> list:
        """The counts of ``slots``: the host's, else read from the device (one sync),
        which the host then keeps unless a capture happened; a bad slot among them is an
        error."""
        if self.host_counts is None:
            # only then may a slot be bad (a capture's, a device reorder's, a loaded state's)
            flags = self.bad[: self.num_slots].tolist()
            bad = [s for s in slots if flags[s]]
            if bad:
                raise ValueError(f"slots: slot {bad[0]} met malformed input (its rows are NaN); "
                                 "reset it before reuse")
            counts = self.count[: self.num_slots].tolist()
            if not self.captured and not any(flags):  # bad slots are checked at every read
                self.host_counts = counts
            return [counts[s] for s in slots]
        return [self.host_counts[s] for s in slots]

    def host_slots(self, slots, name: str = "slots", unique: bool = True) -> list | None:
        """``slots`` (ints, a list or a 1-D integer tensor) checked for type, and for range
        and (``unique``) duplicates where they live on the host: a host list of ints, or
        None for a tensor on the device (checked by its users there)."""
        if isinstance(slots, int) and not isinstance(slots, bool):
            slots = [slots]
        if isinstance(slots, (list, tuple)):
            # type(v) is int first: one call an item where isinstance takes two
            if not all(type(v) is int for v in slots) and not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in slots):
                raise TypeError(f"{name}: expected slot indices as ints, got {list(slots)!r}")
            got = list(slots)
        else:
            check_tensor(name, slots)
            if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
                raise TypeError(f"{name}: expected a 1-D integer tensor of slot indices, got "
                                f"{slots.dtype} {tuple(slots.shape)}")
            if slots.device.type != "cpu":
                return None
            got = slots.tolist()
        if got and (min(got) < 0 or max(got) >= self.num_slots):
            j, v = next((j, v) for j, v in enumerate(got) if not 0 <= v < self.num_slots)
            raise ValueError(f"{name}: slot {v} at index {j} is out of range "
                             f"[0, {self.num_slots})")
        if unique and len(set(got)) != len(got):
            dup = next(v for v in got if got.count(v) > 1)
            raise ValueError(f"{name}: slot {dup} appears more than once in one call")
        return got

    def slot_index(self, slots, name: str = "slots") -> torch.Tensor:
        """``slots`` as an int64 tensor on the state's device, checked on the host where
        they live there (host_slots)."""
        got = self.host_slots(slots, name)
        if got is None:
            return slots.to(device=self.device, dtype=torch.int64)
        return device_ints(got, self.device, staging=self.staging())

    def state_dict(self) -> dict:
        """Tensors and settings; load_state_dict of a state built alike restores it."""
        out = {k: getattr(self, k) for k in _CONFIG}
        out.update({k: getattr(self, k).clone() for k in _TENSORS})
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state_dict of a state built alike; its counts are checked (read on the
        host: one sync where they live on the GPU), since decode and prefill index the
        rings and place rows by them."""
        if not isinstance(sd, dict):
            raise TypeError(f"sd: expected a dict (StreamState.state_dict()), got {type(sd).__name__}")
        for k in _CONFIG:
            if k not in sd or sd[k] != getattr(self, k):
                raise ValueError(f"state_dict[{k!r}]: expected {getattr(self, k)!r} (this state's), "
                                 f"got {sd.get(k)!r}")
        for k in _TENSORS:
            t, mine = sd.get(k), getattr(self, k)
            if not isinstance(t, torch.Tensor) or t.shape != mine.shape or t.dtype != mine.dtype:
                raise ValueError(f"state_dict[{k!r}]: expected a {mine.dtype} tensor of shape "
                                 f"{tuple(mine.shape)}, got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        _check_counts(sd["count"][: self.num_slots].tolist(),
                      sd["last_n"][: self.num_slots].tolist(), self.position_limit,
                      self.max_next_n)
        for k in _TENSORS:
            getattr(self, k).copy_(sd[k])
        self.host_counts = None  # read again at the next prefill


def _check_counts(count: list, last_n: list, limit: int, max_next_n: int) -> None:
    """A slot has seen 0 to ``limit`` tokens, the last ``last_n`` of them (at most
    ``max_next_n``, at most all it has seen) in its last decode step."""
    for s, (c, n) in enumerate(zip(count, last_n)):
        if not 0 <= c <= limit:
            raise ValueError(f"state_dict['count']: slot {s} has seen {c} tokens, expected "
                             f"0 to {limit} (the state's position limit)")
        if not 0 <= n <= min(c, max_next_n):
            raise ValueError(f"state_dict['last_n']: slot {s} took {n} tokens in its last "
                             f"step, expected 0 to min(its count {c}, max_next_n {max_next_n})")


def check_state(state) -> None:
    if not isinstance(state, StreamState):
        raise TypeError(f"state: expected a csa_compressor.streaming.StreamState, got "
                        f"{type(state).__name__}")


def history(ratio: int, coff: int, max_next_n: int) -> tuple:
    """(the ring's tokens a slot, aligned): ``coff*ratio + max_next_n``, or for long coff-1
    windows a multiple of ``ratio`` that holds a window and a step's tokens past it, so
    that no window wraps (aligned: decode pools it in place, where the gather path copied
    every slot's window every step)."""
    if coff == 1 and ratio > ALIGNED_MIN_RATIO and max_next_n <= ratio:
        return (ratio if max_next_n == 1 else 2 * ratio), True
    return coff * ratio + max_next_n, False


def which(slots):
    """For StreamState.follow: None (every slot), a host list, or False (on the device)."""
    if slots is None:
        return None
    got = host_list(slots)
    return False if got is None else got


def host_list(slots):
    """``slots`` as a host list of ints where they live on the host (an int, a list, a CPU
    tensor), else None."""
    if isinstance(slots, int) and not isinstance(slots, bool):
        return [slots]
    if isinstance(slots, (list, tuple)):
        return [int(v) for v in slots]
    if isinstance(slots, torch.Tensor) and slots.device.type == "cpu":
        return slots.tolist()
    return None

