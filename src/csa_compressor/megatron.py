"""Megatron-LM's CSA/HCA ``Compressor`` on the fused kernels.

    from csa_compressor import megatron
    megatron.install()          # or: with megatron.installed(): ...

Megatron's ``Compressor._forward_thd`` calls the module-global
``csa.maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp,
ratio=, head_dim=, coff=, enabled=)`` and runs its eager region when that returns None.
``install()`` replaces that name with this package's adapter, which returns the fused
pooling for every ratio / coff / dtype / head_dim the kernels take (Hopper and
Blackwell), under deterministic mode and ``torch.compile`` too, and None otherwise, with
the reason logged once and kept (``fallback_reasons()``).

Megatron's own ``enabled`` argument (``use_fused_dsa_kernels(config)``, False unless a
DSA kernel backend is configured) is ignored by default: ``install()`` is the opt-in.
``install(respect_enabled=True)`` honours it instead.

SBHD inputs (``Compressor._forward_sbhd``, which has no hook) are routed too: ``install()``
replaces that method with one that runs Megatron's own projections, norm, rotary
embedding and rotation around the fused pooling of the ``b`` sequences of ``sq`` tokens
(one transposed copy of ``kv`` and ``score`` into the packed layout), and calls
Megatron's method unchanged wherever the fused pooling cannot run.

Megatron is imported only by ``install()``, never by ``import csa_compressor``. What is
not routed yet: the context-parallel pre-grouped path, which Megatron runs without the
hook (it stays eager).
"""

from __future__ import annotations

import contextlib
import importlib
import logging

import torch

CSA_MODULE = "megatron.core.transformer.experimental_attention_variant.csa"
HOOK = "maybe_compress_thd_fused"
_log = logging.getLogger("csa_compressor.megatron")
_state = {"module": None, "original": None, "sbhd": None, "respect_enabled": False}
_reasons: dict = {}
_DISABLED = "disabled by Megatron (use_fused_dsa_kernels is False)"


def _csa_module():
    try:
        mod = importlib.import_module(CSA_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"csa_compressor.megatron: cannot import {CSA_MODULE} ({exc}); it needs a Megatron-LM "
            "tree with the CSA/HCA Compressor (branch dev) on sys.path") from exc
    missing = [n for n in (HOOK, "Compressor") if not hasattr(mod, n)]
    if missing:
        raise ImportError(
            f"csa_compressor.megatron: {CSA_MODULE} has no {', '.join(missing)}; this Megatron-LM "
            "is not one whose Compressor calls the fused-pooling hook")
    return mod


def _fallback(reason: str):
    if reason not in _reasons:
        _log.warning("csa_compressor: Megatron's Compressor keeps its eager pooling: %s", reason)
        _reasons[reason] = 0
    _reasons[reason] += 1
    return None


def fallback_reasons() -> dict:
    """Each reason a call kept Megatron's eager pooling, with how many calls it was."""
    return dict(_reasons)


def maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                             head_dim, coff, enabled=True):
    """Megatron's hook: the pooled ``(total_comp, 1, head_dim)`` rows, or None (the caller
    runs its eager region). Never raises on what Megatron passes."""
    if _state["respect_enabled"] and not enabled:
        return _fallback(_DISABLED)
    if not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1] == 1):
        return _fallback(f"kv: expected (T, 1, coff*d), got {tuple(getattr(kv, 'shape', ()))}")
    if not isinstance(head_dim, int) or kv.shape[2] != coff * head_dim:
        return _fallback(f"kv: last dimension {kv.shape[2]} is not coff*head_dim = {coff}*{head_dim}")
    out = _fused_or_fallback(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff)
    return None if out is None else out.unsqueeze(1)


def _fused_or_fallback(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff):
    """The fused pooling ``(total_comp, d)``, or None with the reason recorded; validated
    once, the problem going on to the launch."""
    from .dispatch import _unavailable, fused_from_validated

    try:
        reason, p = _unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                                 coff, True)
    except (TypeError, ValueError) as exc:  # e.g. a mistyped kill switch
        reason = str(exc)
    if reason is not None:
        return _fallback(reason)
    return fused_from_validated(p)


def _forward_sbhd(self, x):
    """Megatron's ``Compressor._forward_sbhd`` with the pooling fused: ``x`` is
    ``(sq, b, hidden)``; returns ``(sq // ratio, b, head_dim)``, or None when ``sq < ratio``."""
    from .dispatch import _device_reason

    original, mod = _state["sbhd"], _state["module"]
    ratio = self.compress_ratio
    sq, b = x.size(0), x.size(1)
    if sq < ratio:
        return original(self, x)
    if _state["respect_enabled"] and not getattr(self, "use_fused_compressor", False):
        _fallback(_DISABLED)
        return original(self, x)
    reason = _device_reason(x.device)
    if reason is not None:
        _fallback(reason)
        return original(self, x)
    with mod.get_fp8_disabled_context(self.config):
        kv, _ = self.linear_wkv(x)  # (sq, b, coff * head_dim)
        score, _ = self.linear_wgate(x)
    n = sq // ratio
    width = kv.shape[-1]
    # The b sequences packed one after another: (b * n * ratio, coff * head_dim).
    kv2 = kv[: n * ratio].transpose(0, 1).reshape(b * n * ratio, width)
    score2 = score[: n * ratio].transpose(0, 1).reshape(b * n * ratio, width)
    steps = torch.arange(b + 1, device=x.device, dtype=torch.int32)
    pooled = _fused_or_fallback(kv2, score2, self.ape, steps * (n * ratio), steps * n, b * n,
                                ratio, self.coff)
    if pooled is None:
        return original(self, x)
    pooled = pooled.view(b, n, self.head_dim).transpose(0, 1)
    kv = self.norm(pooled.to(x.dtype))
    kv = mod._apply_rope(kv, self.head_dim - self.qk_pos_emb_head_dim, self.qk_pos_emb_head_dim,
                         self.rotary_pos_emb, self.config, n, ratio=ratio,
                         cp_group=self.pg_collection.cp)
    if self.rotate:
        kv = mod.rotate_activation(kv)
    return kv


def install(respect_enabled: bool = False) -> None:
    """Route Megatron's Compressor through the fused kernels (idempotent)."""
    if not isinstance(respect_enabled, bool):
        raise TypeError(f"respect_enabled: expected True or False, got {respect_enabled!r}")
    mod = _csa_module()
    if _state["module"] is None:
        _state["module"], _state["original"] = mod, getattr(mod, HOOK)
        _state["sbhd"] = getattr(mod.Compressor, "_forward_sbhd", None)
    _state["respect_enabled"] = respect_enabled
    setattr(mod, HOOK, maybe_compress_thd_fused)
    if _state["sbhd"] is not None:
        mod.Compressor._forward_sbhd = _forward_sbhd


def uninstall() -> None:
    """Restore Megatron's own hook (a no-op when not installed)."""
    if _state["module"] is not None:
        setattr(_state["module"], HOOK, _state["original"])
        if _state["sbhd"] is not None:
            _state["module"].Compressor._forward_sbhd = _state["sbhd"]
        _state["module"] = _state["original"] = _state["sbhd"] = None


def is_installed() -> bool:
    return _state["module"] is not None


@contextlib.contextmanager
def installed(respect_enabled: bool = False):
    """``install()`` for the block, then Megatron's hook back as it was."""
    was, before = is_installed(), _state["respect_enabled"]
    install(respect_enabled)
    try:
        yield
    finally:
        if was:
            _state["respect_enabled"] = before
        else:
            uninstall()
