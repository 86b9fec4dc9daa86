"""transformers' batch-first compressor inputs on this package's ops: ``kv`` / ``gate``
``(B, S, coff*d)`` (the projections' outputs), ``position_bias`` ``(ratio, coff*d)``.

Without a cache every batch row is one sequence of S tokens: the THD op over ``B*S`` rows
(a view, no copy). With a cache the rows come from a streaming state attached to the
cache layer (one per compressor name), fed each call's tokens, so prefill and decode emit
the rows training computes; transformers' own buffers are then not used for that name.
"""

from __future__ import annotations

import torch

from .. import dispatch, kernel_api, runtime, streaming
from .state import options

_STREAMS = "_csa_compressor_streams"  # cache layer attribute: {name: StreamState}


_NEEDS = ("kv_proj", "gate_proj", "position_bias", "kv_norm", "rotary_emb", "compress_rate",
          "head_dim", "rope_layer_type")
_CACHE_NEEDS = ("entry_count", "update_compressor_states")


def cache_reason(layer) -> str | None:
    """Why a cache layer cannot carry the streaming state, or None."""
    missing = [a for a in _CACHE_NEEDS if not hasattr(layer, a)]
    if missing:
        return f"cache layer {type(layer).__name__} has no {', '.join(missing)}"
    return None


def reason(module, hidden_states) -> str | None:
    """Why this compressor call cannot take the fused pooling (before any work), or None."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        return f"hidden_states: expected (batch, seq, hidden), got {type(hidden_states).__name__}"
    missing = [a for a in _NEEDS if not hasattr(module, a)]
    if missing:
        return f"{type(module).__name__} has no {', '.join(missing)}: not the compressor the adapter knows"
    r = runtime.device_reason(hidden_states.device)
    if r is not None:
        return r
    bias = getattr(module, "position_bias", None)
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        # transformers adds a bias of the gate's dtype in that dtype; the kernels add in fp32
        return (f"position_bias is {getattr(bias, 'dtype', None)}, not float32 (load the model "
                "with its keep-in-fp32 modules, e.g. from_pretrained(..., dtype=torch.bfloat16))")
    return None


def stateless(kv, gate, bias, ratio: int, coff: int):
    """(rows (B, S // ratio, d), None) or (None, the reason)."""
    B, S, W = kv.shape
    n = S // ratio
    steps = torch.arange(B + 1, dtype=torch.int32, device=kv.device)
    kv2, gate2 = kv.reshape(B * S, W), gate.reshape(B * S, W)
    why, _ = dispatch.unavailable(kv2, gate2, bias, steps * S, steps * n, B * n, ratio, coff, True)
    if why is not None:
        return None, why
    out = _BatchPool.apply(kv2, gate2, bias, steps * S, steps * n, B, n, ratio, coff,
                           options().numerics)
    return out.view(B, n, W // coff), None


class _BatchPool(torch.autograd.Function):
    """The fused pooling of B sequences of S tokens, whose ``position_bias`` gradient is
    summed as autograd sums transformers' broadcast ``gate.view(B, n, ratio, W) + bias``:
    the backward stores dscore in fp32 (unrounded) and torch reduces it in that shape, so
    the gradient is transformers' bit for bit (the kernels' own dape sums in another
    order)."""

    @staticmethod
    def forward(ctx, kv, gate, bias, cu, cuc, B, n, ratio, coff, numerics):
        W = kv.shape[1]
        out = torch.empty((B * n, W // coff), dtype=kv.dtype, device=kv.device)
        kernel_api.pool_forward(kv, gate, bias, cu, cuc, out, ratio=ratio, coff=coff,
                                numerics=numerics)
        ctx.save_for_backward(kv, gate, bias, cu, cuc)
        ctx.meta = (B, n, ratio, coff, numerics)
        return out

    @staticmethod
    def backward(ctx, grad):
        kv, gate, bias, cu, cuc = ctx.saved_tensors
        B, n, ratio, coff, numerics = ctx.meta
        T, W = kv.shape
        dkv = torch.empty_like(kv)
        dscore = torch.empty((T, W), dtype=torch.float32, device=kv.device)
        kernel_api.pool_backward(kv, gate, bias, cu, cuc, grad.contiguous(), dkv, dscore,
                                 torch.empty_like(bias), ratio=ratio, coff=coff,
                                 numerics=numerics)
        # contiguous, as autograd's gradient of the sum is: the reduction order follows the strides
        windows = dscore.view(B, T // B, W)[:, :n * ratio].reshape(B, n, ratio, W).contiguous()
        return (dkv, dscore.to(gate.dtype), windows.sum_to_size(bias.shape),
                None, None, None, None, None, None, None)


def stream_for(cache_layer, name: str, hidden_states, head_dim: int, ratio: int, coff: int,
               entry_count: int):
    """(the cache layer's streaming state for ``name``, whether it is new), or (None, a
    reason): a layer that already ran transformers' own compressor keeps it (its history
    is in transformers' buffers)."""
    streams = getattr(cache_layer, _STREAMS, None)
    if streams is None:
        streams = {}
        setattr(cache_layer, _STREAMS, streams)
    st = streams.get(name)
    if st is None:
        if entry_count or getattr(cache_layer, "buffer_kv", {}).get(name) is not None:
            return None, "the cache already holds transformers' own compressor state"
        # the projections' outputs will have the hidden states' batch, dtype and device
        st = streaming.StreamState(hidden_states.shape[0], head_dim, ratio=ratio, coff=coff,
                                   dtype=hidden_states.dtype, device=hidden_states.device)
        streams[name] = st
        return st, True
    if st.num_slots != hidden_states.shape[0]:
        return None, (f"batch size changed from {st.num_slots} to {hidden_states.shape[0]} "
                      "within one cache")
    return st, False


def absorb(st, kv, gate) -> None:
    """The call's tokens into a fresh state whose rows the stateless op computed."""
    B, S, W = kv.shape
    streaming.prefill(st, kv.reshape(B * S, W).detach(), gate.reshape(B * S, W).detach(), None,
                      [S * b for b in range(B + 1)], list(range(B)), emit=False)


def streamed(st, kv, gate, bias):
    """(rows (B, n, d), positions (n,)): the rows whose windows this call's tokens closed.
    A generation step (at most the state's max_next_n tokens, no gradient asked) is a
    decode step: static shapes and no host planning, the same rows as prefill's."""
    B, S, W = kv.shape
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (kv, gate, bias))
    if S <= st.max_next_n and not grads:
        seen = st.counts_of([0])[0]  # every slot has seen as many tokens
        n = (seen + S) // st.ratio - seen // st.ratio
        step = streaming.decode(st, kv, gate, bias, numerics=options().numerics,
                                pooling="auto")
        return step.rows[:, :n], step.positions[0, :n]
    out = streaming.prefill(st, kv.reshape(B * S, W), gate.reshape(B * S, W), bias,
                            [S * b for b in range(B + 1)], list(range(B)),
                            numerics=options().numerics, pooling="auto")
    n = out.rows.shape[0] // B  # every slot has seen as many tokens: as many rows each
    return out.rows.view(B, n, st.head_dim), out.positions[:n]


def reorder(cache_layer, beam_idx) -> None:
    for st in getattr(cache_layer, _STREAMS, {}).values():
        st.reorder(beam_idx)


def drop(cache_layer, name: str) -> None:
    getattr(cache_layer, _STREAMS, {}).pop(name, None)


def reset(cache_layer) -> None:
    if getattr(cache_layer, _STREAMS, None):
        setattr(cache_layer, _STREAMS, {})
