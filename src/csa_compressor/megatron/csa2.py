"""Megatron-LM's DeepSeek-V4.1 ``CSA2Compressor`` on the fused pooling: its ``forward``
(SBHD) and ``forward_packed`` (context parallel: explicit row groups), installed by
``install()`` where the csa2 module imports. Megatron's projections and norm run as they
are; only ``pool_groups_with_softmax_gate`` / the grouped softmax sum become the fused
pooling with no position bias (``ape=None``, ``coff=1``), fp32 in and out."""

from __future__ import annotations

import importlib

import torch

from .. import dispatch, runtime
from .state import fallback, installed, options

CSA2_MODULE = "megatron.core.transformer.experimental_attention_variant.csa2.compressor"


def csa2_module():
    """Megatron's csa2 compressor module, or None where this tree has none."""
    try:
        mod = importlib.import_module(CSA2_MODULE)
    except ImportError:
        return None
    return mod if hasattr(mod, "CSA2Compressor") else None


def _reason(comp, x):
    if not getattr(comp, "gated", False):
        return "CSA2 ratio 1: a projection and a norm, nothing to pool"
    if not isinstance(x, torch.Tensor):
        return f"CSA2: expected a tensor of hidden states, got {type(x).__name__}"
    return runtime.device_reason(x.device)


def forward(self, hidden_states):
    """CSA2Compressor.forward with the fused pooling; Megatron's own where it cannot run."""
    original = installed["csa2"]["forward"]
    reason = _reason(self, hidden_states)
    if reason is not None:
        fallback(reason)
        return original(self, hidden_states)
    x = hidden_states.float()
    latent, gate = self.linear_wkv(x), self.linear_wgate(x)
    pooled, reason = dispatch.fused_sbhd_or_reason(latent, gate, None, ratio=self.compress_ratio,
                                                   coff=1, numerics=options().numerics)
    if reason is not None:
        fallback(reason)
        pooled = installed["csa2"]["pool"](latent, gate, self.compress_ratio)
    return self.norm(pooled.to(hidden_states.dtype))


def forward_packed(self, hidden_rows, group_rows):
    """CSA2Compressor.forward_packed with the fused pooling of the groups (a THD pack of
    ``ratio``-token segments on device-built offsets, no host sync)."""
    original = installed["csa2"]["forward_packed"]
    reason = _reason(self, hidden_rows)
    if reason is None and (not isinstance(group_rows, torch.Tensor) or group_rows.dim() != 2
                           or group_rows.shape[1] != self.compress_ratio):
        reason = f"CSA2: group_rows expected (n, {self.compress_ratio}), got " \
                 f"{tuple(getattr(group_rows, 'shape', ()))}"
    if reason is not None or group_rows.numel() == 0:
        if reason is not None:
            fallback(reason)
        return original(self, hidden_rows, group_rows)
    n, r = group_rows.shape
    gathered = hidden_rows[group_rows.reshape(-1)].float()
    latent, gate = self.linear_wkv(gathered), self.linear_wgate(gathered)
    steps = torch.arange(n + 1, dtype=torch.int32, device=hidden_rows.device)
    pooled, reason = dispatch.fused_or_reason(latent, gate, None, steps * r, steps, n, ratio=r,
                                              coff=1, numerics=options().numerics)
    if reason is not None:
        fallback(reason)
        d = latent.shape[-1]
        pooled = (latent.view(n, r, d) * torch.softmax(gate.view(n, r, d), dim=1)).sum(dim=1)
    return self.norm(pooled.to(hidden_rows.dtype))


def patch(mod) -> None:
    cls = mod.CSA2Compressor
    if installed.get("csa2") is None:
        installed["csa2"] = {"module": mod, "forward": cls.forward,
                             "forward_packed": getattr(cls, "forward_packed", None),
                             "pool": mod.pool_groups_with_softmax_gate}
    cls.forward = forward
    if installed["csa2"]["forward_packed"] is not None:
        cls.forward_packed = forward_packed


def unpatch() -> None:
    saved = installed.get("csa2")
    if saved is None:
        return
    cls = saved["module"].CSA2Compressor
    cls.forward = saved["forward"]
    if saved["forward_packed"] is not None:
        cls.forward_packed = saved["forward_packed"]
    installed["csa2"] = None
