"""``CompressorV41``: DeepSeek-V4.1's compressor (Megatron-LM's ``CSA2Compressor``) as an
``nn.Module``: fp32 projections of the hidden states, the gated pooling with no position
bias and no overlap (``ape=None``, ``coff=1``), the rows rounded to the input dtype, then
RMSNorm; ratio 1 is a projection and the norm. No RoPE: the attention rotates later.
Made by ``Compressor.v41(...)``."""

from __future__ import annotations

import torch
from torch import nn

from . import reference
from .checks import SUPPORTED_DTYPES, check_int, check_tensor
from .dispatch import fused_or_reason, fused_sbhd_or_reason
from .layout import compressed_capacity, compressed_cu_seqlens

POOLING = ("auto", "fused", "reference")


def megatron_mapped(state_dict, keys: dict, strict: bool, what: str) -> dict:
    """A Megatron-LM module's ``state_dict`` under this package's names (``keys``: theirs
    to ours); Transformer Engine's ``_extra_state`` entries skipped, any other key not in
    ``keys`` an error where ``strict``, else skipped."""
    mapped = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        if key not in keys:
            if strict:
                raise KeyError(f"state_dict: unexpected key {key!r} for {what} (expected "
                               f"{sorted(keys)})")
            continue
        mapped[keys[key]] = value
    return mapped


class CompressorV41(nn.Module):
    """``wkv`` (and, at ratio > 1, ``wgate``): hidden -> head_dim, fp32 at ratio > 1 (the
    checkpoint ``dtype`` at ratio 1); ``norm_weight`` ``(head_dim,)`` in ``dtype``, applied
    with torch's ``rms_norm`` as Megatron's torch norm applies it. ``pooling``: "auto"
    (the fused kernels where they run, else the reference), "fused" or "reference"."""

    MEGATRON_KEYS = {"linear_wkv.weight": "wkv.weight", "linear_wgate.weight": "wgate.weight",
                     "norm.weight": "norm_weight"}

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, *, norm_eps: float = 1e-6,
                 dtype=torch.bfloat16, device=None, pooling: str = "auto"):
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_int("head_dim", head_dim, 1)
        check_int("ratio", ratio, 1)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {dtype!r}")
        if pooling not in POOLING:
            raise ValueError(f"pooling: expected one of {POOLING}, got {pooling!r}")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or norm_eps <= 0:
            raise ValueError(f"norm_eps: expected a number > 0, got {norm_eps!r}")
        self.hidden_size, self.head_dim, self.ratio = hidden_size, head_dim, ratio
        self.norm_eps, self.pooling, self.dtype = norm_eps, pooling, dtype
        self.gated = ratio > 1
        proj = torch.float32 if self.gated else dtype
        self.wkv = nn.Linear(hidden_size, head_dim, bias=False, dtype=proj, device=device)
        self.wgate = (nn.Linear(hidden_size, head_dim, bias=False, dtype=proj, device=device)
                      if self.gated else None)
        self.norm_weight = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device))

    def load_megatron_state_dict(self, state_dict, strict: bool = True):
        """Load a Megatron-LM ``CSA2Compressor``'s ``state_dict``."""
        keys = {k: v for k, v in self.MEGATRON_KEYS.items() if self.gated or k != "linear_wgate.weight"}
        return self.load_state_dict(megatron_mapped(state_dict, keys, strict,
                                                    f"a CSA2Compressor of ratio {self.ratio}"),
                                    strict=strict)

    def _norm(self, rows):
        return nn.functional.rms_norm(rows, (self.head_dim,), self.norm_weight, self.norm_eps)

    def _pooled(self, fused, fallback):
        if self.pooling != "reference":
            out, reason = fused()
            if reason is None:
                return out
            if self.pooling == "fused":
                raise RuntimeError(f"CompressorV41(pooling='fused'): {reason}")
        return fallback()

    def forward(self, x, cu_seqlens=None, max_seqlen=None, total_comp=None):
        """SBHD: ``x`` ``(S, B, hidden)`` -> ``(S // ratio, B, head_dim)``. THD
        (``cu_seqlens`` given): ``x`` ``(T, hidden)`` -> ``(rows (N, head_dim),
        cu_seqlens_comp)``, ``N`` as Compressor's (``total_comp``, else the capacity from
        ``max_seqlen``, else the true count)."""
        check_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected hidden size {self.hidden_size} in the last dim, got "
                             f"shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise TypeError(f"x: expected the module's dtype {self.dtype}, got {x.dtype}")
        if cu_seqlens is None:
            if x.dim() != 3:
                raise ValueError(f"x: expected (S, B, hidden) without cu_seqlens, got {tuple(x.shape)}")
            return self._sbhd(x)
        check_tensor("cu_seqlens", cu_seqlens)
        if x.dim() != 2:
            raise ValueError(f"x: expected (T, hidden) with cu_seqlens, got {tuple(x.shape)}")
        cuc = compressed_cu_seqlens(cu_seqlens, self.ratio)
        if total_comp is None:
            total_comp = (int(cuc[-1]) if max_seqlen is None else compressed_capacity(
                x.shape[0], cu_seqlens.numel() - 1, int(max_seqlen), self.ratio))
        check_int("total_comp", total_comp, 0)
        return self._thd(x, cu_seqlens, cuc, total_comp), cuc

    def _sbhd(self, x):
        if not self.gated:
            return self._norm(self.wkv(x))
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)
        kw = dict(ratio=self.ratio, coff=1)
        pooled = self._pooled(lambda: fused_sbhd_or_reason(kv, score, None, **kw),
                              lambda: reference.compress_sbhd(kv, score, None, **kw))
        return self._norm(pooled.to(x.dtype))

    def _thd(self, x, cu, cuc, total_comp):
        if not self.gated:
            # ratio 1: every token a row (rows past the pack's: its padding tokens' own)
            rows = self._norm(self.wkv(x))[:total_comp]
            short = total_comp - rows.shape[0]
            return torch.cat([rows, rows.new_zeros((short, self.head_dim))]) if short else rows
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)
        args = (kv, score, None, cu, cuc, total_comp)
        kw = dict(ratio=self.ratio, coff=1)
        pooled = self._pooled(lambda: fused_or_reason(*args, **kw),
                              lambda: reference.compress_thd(*args, **kw))
        return self._norm(pooled.to(x.dtype))
