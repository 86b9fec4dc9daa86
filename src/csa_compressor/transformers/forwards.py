"""The installed forwards of transformers' DeepSeek-V4 compressors (HCA, CSA and the CSA
indexer's own): the pooling on this package's ops, the rest as transformers computes it
(its projections, ``kv_norm``, rotary embedding, cache bookkeeping and masks, called
where they are modules or methods, restated where they are inline). Where the fused
pooling cannot run, the class's own forward runs and ``fallback_reasons()`` says why."""

from __future__ import annotations

import torch

from . import pooling
from .state import fallback, installed


def _own(module):
    return installed["classes"][type(module)]


def _compressed(module, hidden_states, cache, layer_idx, name, coff):
    """(rows after kv_norm and RoPE (B, n, d) or None, the cache layer): None where the
    fused pooling does not take this call (the reason recorded)."""
    why = pooling.reason(module, hidden_states)
    layer = cache.layers[layer_idx] if cache is not None else None
    if why is None and layer is not None:
        why = pooling.cache_reason(layer)
    if why is not None:
        return fallback(why), layer
    r = module.compress_rate
    st = fresh = None
    if layer is not None:
        st, fresh = pooling.stream_for(layer, name, hidden_states, module.head_dim, r, coff,
                                       layer.entry_count[name])
        if st is None:
            return fallback(fresh), layer
        if not fresh and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            raise RuntimeError("csa_compressor.transformers: gradients through a second call on "
                               "one cache are not supported; train without a cache "
                               "(use_cache=False) or uninstall()")
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    if st is None or fresh:
        # a first call: every window from token 0, the training op's (differentiable) rows
        rows, why = pooling.stateless(kv, gate, module.position_bias, r, coff)
        if why is not None:
            if fresh:  # transformers' own code keeps this name of the cache from here
                pooling.drop(layer, name)
            return fallback(why), layer
        first = torch.arange(rows.shape[1], device=rows.device) * r
        if fresh:
            pooling.absorb(st, kv, gate)
    else:
        rows, first = pooling.streamed(st, kv, gate, module.position_bias)
    rows = module.kv_norm(rows)
    if rows.shape[1]:
        positions = first.unsqueeze(0).expand(rows.shape[0], -1)
        cos, sin = module.rotary_emb(rows, position_ids=positions, layer_type=module.rope_layer_type)
        rows = installed["helpers"](rows.unsqueeze(1), cos, sin).squeeze(1)
    if layer is not None:
        rows = layer.update_compressor_states(name, rows)
    return rows, layer


def _cache(cache, past_key_values):
    return cache if cache is not None else past_key_values


def hca_forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx=None,
                past_key_values=None):
    cache = _cache(cache, past_key_values)
    rows, _ = _compressed(self, hidden_states, cache, layer_idx, "compressor", 1)
    if rows is None:
        return _own(self)(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    entries = rows.unsqueeze(1)  # (B, 1, n, d)
    n, seq = entries.shape[2], position_ids.shape[1]
    if seq == 1 or n == 0:
        return entries, None
    # query t sees entry w only where w * ratio + ratio <= t + 1
    visible = torch.arange(n, device=entries.device) < ((position_ids + 1) // self.compress_rate)[..., None]
    bias = entries.new_zeros((entries.shape[0], 1, seq, n))
    return entries, bias.masked_fill(~visible.unsqueeze(1), float("-inf"))


def csa_forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx=None,
                past_key_values=None):
    cache = _cache(cache, past_key_values)
    rows, _ = _compressed(self, hidden_states, cache, layer_idx, "compressor", 2)
    if rows is None:
        return _own(self)(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    entries = rows.unsqueeze(1)
    picks = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)  # (B, S, k)
    n, (B, seq) = entries.shape[2], hidden_states.shape[:2]
    # an extra column takes the indexer's -1 (invalid) picks, then goes
    where = torch.where(picks >= 0, picks, torch.full_like(picks, n))
    bias = entries.new_full((B, 1, seq, n + 1), float("-inf"))
    bias.scatter_(-1, where.unsqueeze(1), 0.0)
    return entries, bias[..., :n]


def indexer_forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx=None,
                    past_key_values=None):
    cache = _cache(cache, past_key_values)
    keys, _ = _compressed(self, hidden_states, cache, layer_idx, "indexer", 2)
    if keys is None:
        return _own(self)(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    B, seq = hidden_states.shape[:2]
    cos, sin = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(B, seq, -1, self.head_dim).transpose(1, 2)
    q = installed["helpers"](q, cos, sin).transpose(1, 2)
    scores = self.scorer(q, keys, hidden_states)  # (B, S, n)
    n = keys.shape[1]
    k = min(self.index_topk, n)
    if n == 0:
        return scores.topk(k, dim=-1).indices
    ready = ((position_ids + 1) // self.compress_rate).unsqueeze(-1)  # entries query t may see
    future = torch.arange(n, device=scores.device).view(1, 1, -1) >= ready
    picks = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
    return torch.where(picks >= ready, torch.full_like(picks, -1), picks)
