"""Streaming compression for generation: prefill chunks and decode steps, each emitted row
bitwise the training op's row for that window (same numerics, same epilogue).

- ``StreamState(num_slots, head_dim, ratio=, coff=, dtype=, device=, max_next_n=4,
  max_seqlen=None)``: per-slot state, allocated once (CUDA-graph friendly);
  ``state_dict()`` / ``load_state_dict()``, ``reset(slots)``.
- ``prefill(state, kv, score, ape, cu_seqlens, slots, ...) -> Rows``: ragged chunks.
- ``decode(state, kv, score, ape, slots=None, ...) -> Step``: ``next_n`` tokens a slot,
  static shapes, capturable.
- ``take_back(state, k, slots=None)``: undo the last ``k`` tokens of a decode step.
"""

from .steps import Step, decode, take_back
from .chunks import Rows, prefill
from .state import StreamState

__all__ = ["Rows", "Step", "StreamState", "decode", "prefill", "take_back"]
