"""Megatron's Compressor methods with the fused kernels: the pooling hook, ``_forward_sbhd``
and ``_forward_thd`` (the installed replacements), and the checks that decide, per call,
whether the fused pooling, epilogue and projection compute what Megatron's code does."""

from __future__ import annotations

import importlib
import weakref

import torch

from .. import dispatch
from ..epilogue import Epilogue, grouped_positions, rope_positions, sbhd_positions
from ..fused_epilogue import Finish
from ..grouped import grouped_offsets
from ..layout import compressed_cu_seqlens
from ..module import joint_projection_as_stored
from .. import runtime
from .state import DISABLED, EPILOGUE, PROJECTION, fallback, installed, options


CSA_MODULE = "megatron.core.transformer.experimental_attention_variant.csa"
HOOK = "maybe_compress_thd_fused"
_freqs = weakref.WeakKeyDictionary()  # rotary module -> its fp64 frequencies (_rope_freqs)


def csa_module():
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


def maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                             head_dim, coff, enabled=True):
    """Megatron's hook: the pooled ``(total_comp, 1, head_dim)`` rows, or None (the caller
    runs its eager region). Never raises on what Megatron passes."""
    if options().respect_enabled and not enabled:
        return fallback(DISABLED)
    if not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1] == 1):
        return fallback(f"kv: expected (T, 1, coff*d), got {tuple(getattr(kv, 'shape', ()))}")
    if not isinstance(head_dim, int) or kv.shape[2] != coff * head_dim:
        return fallback(f"kv: last dimension {kv.shape[2]} is not coff*head_dim = {coff}*{head_dim}")
    out = _fused_or_fallback(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff)
    return None if out is None else out.unsqueeze(1)


def _fused_or_fallback(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                       packed=False, score_first=False, finish=None, offsets_built=False):
    """The fused pooling ``(total_comp, d)``, or None with the reason recorded; validated
    once, the problem going on to the launch. ``packed``: ``kv`` is ``[kv | score]`` (or
    ``[score | kv]`` where ``score_first``) as one ``(T, 2 * coff * d)`` tensor and
    ``score`` is None. ``finish`` (_finish_for): the epilogue's output instead.
    ``offsets_built``: offsets well formed by construction (grouped_offsets'), which the
    kernels need not check on the device."""
    try:
        reason, p = dispatch.unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                                 coff, True, packed, score_first=score_first)
    except (TypeError, ValueError) as exc:  # e.g. a mistyped kill switch
        reason = str(exc)
    if reason is not None:
        return fallback(reason)
    p.offsets_built = offsets_built
    return dispatch.fused_from_validated(p, numerics=options().numerics, finish=finish)


def _method_reason(comp, x):
    """Why a replaced Compressor method keeps Megatron's own code, or None: its ``enabled``
    flag where install(respect_enabled=True) asked for it, then the device."""
    if options().respect_enabled and not getattr(comp, "use_fused_compressor", False):
        return DISABLED
    return runtime.device_reason(x.device)


def _epilogue_reason(comp, grouped: bool):
    """Why Megatron's own norm, RoPE and rotation run after the fused pooling under
    install(epilogue=True), or None where the fused epilogue computes what they do."""
    norm, d = comp.norm, comp.head_dim
    if type(norm).__name__ != "RMSNorm":  # torch's (WrappedTorchNorm) or Transformer Engine's
        return f"norm: expected an RMSNorm, got {type(norm).__name__}"
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d,):
        return f"norm: expected a ({d},) weight, got {tuple(getattr(w, 'shape', ())) or None}"
    if getattr(norm, "bias", None) is not None:
        return "norm: it has a bias"
    if getattr(norm, "zero_centered_gamma", False) or \
            getattr(comp.config, "layernorm_zero_centered_gamma", False):
        return "norm: zero-centred gamma"
    eps = getattr(norm, "eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        return f"norm: expected an eps > 0, got {eps!r}"
    rope_dim = comp.qk_pos_emb_head_dim
    if rope_dim:
        rope = comp.rotary_pos_emb
        if not callable(getattr(rope, "get_emb", None)):
            return f"rotary_pos_emb: expected Megatron's RotaryEmbedding, got {type(rope).__name__}"
        if getattr(comp.config, "rotary_interleaved", False) or getattr(rope, "rotary_interleaved", False):
            return "rotary_interleaved tables"
        if getattr(rope, "seq_len_interpolation_factor", None) is not None:
            return "rotary seq_len_interpolation_factor"
        inv = getattr(rope, "inv_freq", None)
        if not isinstance(inv, torch.Tensor) or 2 * inv.numel() != rope_dim:
            return (f"rotary_pos_emb: its tables have {2 * getattr(inv, 'numel', lambda: 0)()} "
                    f"channels, expected qk_pos_emb_head_dim = {rope_dim}")
    if comp.rotate and d & (d - 1):
        return f"rotate: head_dim {d} is not a power of two"
    cp = getattr(comp.pg_collection, "cp", None)
    if not grouped and cp is not None and cp.size() > 1:  # its positions follow the CP split
        return "context parallelism outside the pre-grouped path"
    return None


def _rope_freqs(comp, device):
    """Megatron's fp32 rotary frequencies of ``comp`` (its rotary module's angles at position
    1: RoPE base, llama scaling or YaRN as that module makes them), as fp64 on ``device``;
    a fp32 product of a position and these is Megatron's angle bit for bit. Kept a module
    and device, made afresh while torch.compile traces or a CUDA graph captures."""
    rope, half = comp.rotary_pos_emb, comp.qk_pos_emb_head_dim // 2
    fresh = torch.compiler.is_compiling() or (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    hit = None if fresh else _freqs.get(rope)
    if hit is not None and hit.device == device:
        return hit
    emb = rope.get_emb(2)  # its width checked by _epilogue_reason
    emb = emb[0] if isinstance(emb, tuple) else emb  # YaRN's (emb, mscale); mscale is 1 here
    freqs = emb[1].reshape(-1)[:half].to(device=device, dtype=torch.float64)
    if not fresh:
        _freqs[rope] = freqs
    return freqs


def _finish_for(comp, positions):
    """The fused epilogue of ``comp`` at ``positions`` (a fused_epilogue.Finish): its norm
    weight and eps, its rotary frequencies (interleaved pairs, as Megatron's MLA rotary
    embedding takes them) and its rotation."""
    rope_dim = comp.qk_pos_emb_head_dim
    freqs = _rope_freqs(comp, positions.device) if rope_dim else None
    # rope_theta is not read: the frequencies are given
    ep = Epilogue(float(comp.norm.eps), rope_dim, 10000.0, True, None, bool(comp.rotate))
    return Finish(ep, comp.norm.weight, positions, inv_freq=freqs)


def _fused_epilogue(comp, rows, positions):
    """``rows`` ``(N, head_dim)`` through the fused epilogue (_finish_for)."""
    return _finish_for(comp, positions).apply(rows)


def _epilogue_on(comp, grouped: bool) -> bool:
    """Whether install(epilogue=True) asked for the fused epilogue and ``comp`` takes it
    (the reason recorded where it does not)."""
    if not options().epilogue:
        return False
    reason = _epilogue_reason(comp, grouped)
    if reason is not None:
        fallback(EPILOGUE + reason)
    return reason is None


def _projection_reason(comp):
    """Why Megatron's two linears run under install(projection=True), or None where one
    GEMM on their weights computes what they compute."""
    cfg, width = comp.config, comp.coff * comp.head_dim
    if getattr(cfg, "fp8", None):
        return "fp8 training"
    if getattr(cfg, "delay_wgrad_compute", False):
        return "delay_wgrad_compute"
    ws = []
    for name in ("linear_wkv", "linear_wgate"):
        lin = getattr(comp, name)
        w = getattr(lin, "weight", None)
        if not isinstance(w, torch.Tensor) or type(w.data) is not torch.Tensor or w.dim() != 2 \
                or w.shape[0] != width:
            return f"{name}: expected a plain ({width}, hidden) weight"
        if isinstance(getattr(lin, "bias", None), torch.Tensor):
            return f"{name}: it has a bias"
        for flag in ("sequence_parallel", "allreduce_dgrad", "explicit_expert_comm"):
            if getattr(lin, flag, False):
                return f"{name}: {flag}"
        ws.append(w)
    if ws[0].shape != ws[1].shape or ws[0].dtype != ws[1].dtype or ws[0].device != ws[1].device:
        return "linear_wkv and linear_wgate: weights of different shapes, dtypes or devices"
    return None


def _projection_on(comp) -> bool:
    """Whether install(projection=True) asked for one projection GEMM and ``comp`` takes it
    (the reason recorded where it does not)."""
    if not options().projection:
        return False
    reason = _projection_reason(comp)
    if reason is not None:
        fallback(PROJECTION + reason)
    return reason is None


def _joint(comp, x):
    """``(kvs, score_first)``: ``[kv | score]`` of ``x`` through one GEMM on ``comp``'s two
    linears' weights, or ``[score | kv]`` where its DDP parameter buffer holds ``wgate``
    right before ``wkv`` (the GEMM reads them in place: no concatenation a step)."""
    return joint_projection_as_stored(x, comp.linear_wkv.weight, comp.linear_wgate.weight)


def forward_sbhd(self, x):
    """Megatron's ``Compressor._forward_sbhd`` with the pooling fused: ``x`` is
    ``(sq, b, hidden)``; returns ``(sq // ratio, b, head_dim)``, or None when ``sq < ratio``."""
    original, mod = installed["sbhd"], installed["module"]
    ratio = self.compress_ratio
    sq = x.size(0)
    if sq < ratio:
        return original(self, x)
    reason = _method_reason(self, x)
    if reason is not None:
        fallback(reason)
        return original(self, x)
    joint, score_first = _projection_on(self), False
    with mod.get_fp8_disabled_context(self.config):
        if joint:
            (kv, score_first), score = _joint(self, x), None  # (sq, b, 2 * coff * head_dim)
        else:
            kv, _ = self.linear_wkv(x)  # (sq, b, coff * head_dim)
            score, _ = self.linear_wgate(x)

    n, b = sq // ratio, x.shape[1]
    epilogue, fin = _epilogue_on(self, grouped=False), None
    if epilogue:

        positions = sbhd_positions(n, b, ratio, x.device)
        if kv.dtype == x.dtype:  # the pooling kernel runs it inside (the same bits)
            fin = _finish_for(self, positions)
    try:
        pooled, reason = dispatch.fused_sbhd_or_reason(kv, score, self.ape, ratio=ratio, coff=self.coff,
                                              packed=joint, score_first=score_first,
                                              numerics=options().numerics, finish=fin)
    except (TypeError, ValueError) as exc:  # e.g. a mistyped kill switch
        pooled, reason = None, str(exc)
    if pooled is None:
        fallback(reason)
        return original(self, x)
    if fin is not None:
        return pooled
    if epilogue:
        d = pooled.shape[2]
        rows = pooled.to(x.dtype).reshape(n * b, d)
        return _fused_epilogue(self, rows, positions).view(n, b, d)
    kv = self.norm(pooled.to(x.dtype))
    kv = mod._apply_rope(kv, self.head_dim - self.qk_pos_emb_head_dim, self.qk_pos_emb_head_dim,
                         self.rotary_pos_emb, self.config, n, ratio=ratio,
                         cp_group=self.pg_collection.cp)
    if self.rotate:
        kv = mod.rotate_activation(kv)
    return kv


def forward_thd(self, x, cu_seqlens, max_seqlen_q=None, compressed_group_ids=None,
                 fixed_total_comp=None):
    """Megatron's ``Compressor._forward_thd``; its pre-grouped (context-parallel) calls with
    the pooling fused: ``x`` ``(G * ratio, 1, hidden)``, returns ``((G, 1, head_dim), None)``."""

    mod = installed["module"]

    def eager():  # Megatron's own method, unchanged
        return installed["thd"](self, x, cu_seqlens, max_seqlen_q, compressed_group_ids,
                             fixed_total_comp)

    ids = compressed_group_ids
    if ids is None and (options().epilogue or options().projection):
        return _thd_fused(self, x, cu_seqlens, max_seqlen_q, fixed_total_comp, eager)
    if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        return eager()
    reason = _method_reason(self, x)
    if reason is None and ids.dtype not in (torch.int32, torch.int64):
        reason = f"compressed_group_ids: expected int32 or int64, got {ids.dtype}"
    if reason is None and x.shape[0] != ids.numel() * self.compress_ratio:
        reason = (f"x: expected {ids.numel()} groups x ratio {self.compress_ratio} rows, got "
                  f"{x.shape[0]}")
    if reason is not None:
        fallback(reason)
        return eager()
    ratio, G = self.compress_ratio, ids.numel()
    cu, cuc = grouped_offsets(ids, ratio)
    # The THD op itself, not compress_grouped: padding groups (ids < 0) take gradient like
    # Megatron's continuations do.
    if _projection_on(self):
        kvs, score_first = _joint(self, x)
        pooled = _fused_or_fallback(kvs.view(G * ratio, -1), None, self.ape, cu, cuc, G, ratio,
                                    self.coff, packed=True, score_first=score_first,
                                    offsets_built=True)
    else:
        kv, _ = self.linear_wkv(x)  # (G * ratio, 1, coff * head_dim)
        score, _ = self.linear_wgate(x)
        pooled = _fused_or_fallback(kv.view(G * ratio, -1), score.view(G * ratio, -1),
                                    self.ape, cu, cuc, G, ratio, self.coff, offsets_built=True)
    if pooled is None:
        return eager()
    if _epilogue_on(self, grouped=True):

        out = _fused_epilogue(self, pooled.to(x.dtype), grouped_positions(ids, ratio))
        return out.unsqueeze(1), None
    out = self.norm(pooled.unsqueeze(1).to(x.dtype))
    rope_dim = self.qk_pos_emb_head_dim
    position_ids = ids.clamp_min(0) * ratio
    if self.config.apply_rope_fusion:
        cos, sin = self.rotary_pos_emb.get_cached_cos_sin(int(max_seqlen_q), dtype=out.dtype,
                                                          packed_seq=True, mscale=1.0)
        out = mod.fused_mla_rope_inplace(out, cos, sin, self.head_dim - rope_dim, rope_dim,
                                         cu_seqlens_q=cu_seqlens, remove_interleaving=True,
                                         position_ids=position_ids)
    else:
        emb = self.rotary_pos_emb(int(max_seqlen_q), packed_seq=True)
        emb = emb[0] if isinstance(emb, tuple) else emb
        out = mod._apply_unfused_rope(out, torch.index_select(emb, 0, position_ids.long()),
                                      self.head_dim - rope_dim, rope_dim, self.config, None,
                                      self.pg_collection.cp)
    if self.rotate:
        out = mod.rotate_activation(out)
    return out, None


def _thd_fused(self, x, cu_seqlens, max_seqlen_q, fixed_total_comp, eager):
    """Megatron's THD path under install(epilogue=True) and / or install(projection=True):
    its projections (one GEMM where asked and taken), the fused pooling, then the fused
    epilogue at its positions (``block_index * ratio``, capacity padding rows held where its
    rotary table ends) or its own norm, RoPE and rotation. Its own method runs a call
    neither applies to, one the pooling cannot take (the reason recorded), or one without
    ``max_seqlen_q`` (Megatron raises its own error)."""

    # where the pooling cannot be fused, Megatron's method asks the hook, which says why
    if _method_reason(self, x) is not None or max_seqlen_q is None:
        return eager()
    fused_epilogue, joint = _epilogue_on(self, grouped=False), _projection_on(self)
    if not (fused_epilogue or joint):
        return eager()
    ratio, mod = self.compress_ratio, installed["module"]
    cuc = compressed_cu_seqlens(cu_seqlens, ratio).to(cu_seqlens.dtype)
    total_comp = int(fixed_total_comp) if fixed_total_comp is not None else int(cuc[-1].item())
    if total_comp == 0:
        return None, cuc
    positions = None
    if fused_epilogue:
        positions = rope_positions(cuc, total_comp, ratio, int(max_seqlen_q))
    if joint:
        kvs, score_first = _joint(self, x)  # (total, 1, 2 * coff * head_dim)
        # with the epilogue, the pooling kernel runs it inside (the same bits)
        fin = _finish_for(self, positions) if fused_epilogue and kvs.dtype == x.dtype else None
        pooled = _fused_or_fallback(kvs.view(kvs.shape[0], -1), None, self.ape, cu_seqlens, cuc,
                                    total_comp, ratio, self.coff, packed=True,
                                    score_first=score_first, finish=fin)
        if pooled is not None and fin is not None:
            return pooled.unsqueeze(1), cuc
    else:
        kv, _ = self.linear_wkv(x)  # (total, 1, coff * head_dim)
        score, _ = self.linear_wgate(x)
        pooled = maybe_compress_thd_fused(kv, score, self.ape, cu_seqlens, cuc, total_comp,
                                          ratio=ratio, head_dim=self.head_dim, coff=self.coff,
                                          enabled=self.use_fused_compressor)
        pooled = None if pooled is None else pooled.squeeze(1)
    if pooled is None:
        return eager()
    rows = pooled.to(x.dtype)
    if fused_epilogue:
        return _fused_epilogue(self, rows, positions).unsqueeze(1), cuc
    # Megatron's own THD epilogue, as its method runs it
    out = self.norm(rows.unsqueeze(1))
    r = self.qk_pos_emb_head_dim
    out = mod._apply_rope(out, self.head_dim - r, r, self.rotary_pos_emb, self.config,
                          rotary_seq_len=0, ratio=ratio, cp_group=self.pg_collection.cp,
                          cu_seqlens=cuc, max_seqlen_rope=(max_seqlen_q // ratio) * ratio)
    if self.rotate:
        out = mod.rotate_activation(out)
    return out, cuc


