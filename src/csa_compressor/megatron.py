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
(the projections' ``(sq, b, coff*d)`` outputs read in place: compress_sbhd_fused; a
transposed copy into the THD layout where their rows are not 16-byte multiples), and
calls Megatron's method unchanged wherever the fused pooling cannot run.

The context-parallel path (``Compressor._forward_thd(..., compressed_group_ids=ids)``,
rows already packed in groups of ``ratio`` tokens, which skips the hook) is routed too:
``install()`` wraps ``_forward_thd`` so that pre-grouped calls run Megatron's projections,
the fused pooling of the groups (a THD pack on device-built offsets, no host sync), then
its norm, rotary embedding at ``max(id, 0) * ratio`` and rotation; other calls go to
Megatron's method unchanged. One row differs by design: where ``ids[0] != 0`` Megatron's
eager code fills row 0's previous-block slots from the buffer's last group
(``torch.roll``), here they are empty (a first block). In Megatron's layout that row is the
previous rank's halo (its boundary window is ``2 * ratio`` tokens at ratio 4, the only
overlapping ratio), so its output is never consumed and takes no gradient.

``install(epilogue=True)`` also replaces what follows the pooling on all three paths:
Megatron's norm, rotary embedding and rotation run as this package's fused epilogue
(``apply_epilogue``: fp32 math, one rounding; Megatron rounds after the norm and at each
step of its bf16 rotary embedding), with Megatron's own norm weight and eps, its rotary
frequencies (read from its rotary module, so YaRN included) and its positions. Where its
configuration is one the epilogue does not compute (another norm, zero-centred gamma,
interleaved rotary tables, interpolated positions, context parallelism outside the
pre-grouped path), Megatron's own epilogue runs after the fused pooling and
``fallback_reasons()`` says why.

``install(projection=True)`` runs Megatron's two projections (``linear_wkv``,
``linear_wgate``) as one GEMM into ``[kv | score]`` on all three paths, whose halves the
pooling reads in place: the backward then has one input-gradient GEMM and no add of two
``(T, hidden)`` gradients. It reads the two linears' weights (their concatenation a step,
or in place where one follows the other in memory) and takes their gradients through
autograd (``.grad``, which Megatron's DDP hooks add into ``main_grad``). Where the linears
do more than a plain GEMM (a bias, sequence or tensor parallelism, fp8,
``delay_wgrad_compute``), Megatron's linears run and ``fallback_reasons()`` says why.
With both, ``install(epilogue=True, projection=True)``, Megatron's Compressor computes
what this package's ``Compressor`` computes with its parameters.

``install(numerics="eager")`` has the fused pooling round the softmax weights and products
to the dtype as Megatron's eager region does; alone (no epilogue, no projection) Megatron's
Compressor then computes what it computes without this package, its ape gradient summed
in another order.

Megatron is imported only by ``install()``, never by ``import csa_compressor``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import weakref

import torch

CSA_MODULE = "megatron.core.transformer.experimental_attention_variant.csa"
HOOK = "maybe_compress_thd_fused"
_log = logging.getLogger("csa_compressor.megatron")
_state = {"module": None, "original": None, "sbhd": None, "thd": None, "respect_enabled": False,
          "epilogue": False, "projection": False, "numerics": "fp32"}
_reasons: dict = {}
_DISABLED = "disabled by Megatron (use_fused_dsa_kernels is False)"
_EPILOGUE = "epilogue: "  # the prefix of the reasons Megatron's own epilogue ran
_PROJECTION = "projection: "  # ... and its own two linears
_freqs = weakref.WeakKeyDictionary()  # rotary module -> its fp64 frequencies (_rope_freqs)


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
        what = ("its norm, RoPE and rotation" if reason.startswith(_EPILOGUE)
                else "its two linears" if reason.startswith(_PROJECTION) else "its eager pooling")
        _log.warning("csa_compressor: Megatron's Compressor keeps %s: %s", what, reason)
        _reasons[reason] = 0
    _reasons[reason] += 1
    return None


def fallback_reasons() -> dict:
    """Each reason a call kept Megatron's eager pooling (or, prefixed ``"epilogue: "``,
    Megatron's own norm, RoPE and rotation under ``install(epilogue=True)``; prefixed
    ``"projection: "``, its own two linears under ``install(projection=True)``), with how
    many calls it was."""
    return dict(_reasons)


def clear_fallback_reasons() -> None:
    """Forget the reasons recorded so far (each is logged again the next time it occurs)."""
    _reasons.clear()


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


def _fused_or_fallback(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                       packed=False, score_first=False, finish=None):
    """The fused pooling ``(total_comp, d)``, or None with the reason recorded; validated
    once, the problem going on to the launch. ``packed``: ``kv`` is ``[kv | score]`` (or
    ``[score | kv]`` where ``score_first``) as one ``(T, 2 * coff * d)`` tensor and
    ``score`` is None. ``finish`` (_finish_for): the epilogue's output instead."""
    from .dispatch import _unavailable, fused_from_validated

    try:
        reason, p = _unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                                 coff, True, packed, score_first=score_first)
    except (TypeError, ValueError) as exc:  # e.g. a mistyped kill switch
        reason = str(exc)
    if reason is not None:
        return _fallback(reason)
    return fused_from_validated(p, numerics=_state["numerics"], finish=finish)


def _method_reason(comp, x):
    """Why a replaced Compressor method keeps Megatron's own code, or None: its ``enabled``
    flag where install(respect_enabled=True) asked for it, then the device."""
    from .dispatch import _device_reason

    if _state["respect_enabled"] and not getattr(comp, "use_fused_compressor", False):
        return _DISABLED
    return _device_reason(x.device)


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
    from .epilogue import Epilogue
    from .fused_epilogue import Finish

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
    if not _state["epilogue"]:
        return False
    reason = _epilogue_reason(comp, grouped)
    if reason is not None:
        _fallback(_EPILOGUE + reason)
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
    if not _state["projection"]:
        return False
    reason = _projection_reason(comp)
    if reason is not None:
        _fallback(_PROJECTION + reason)
    return reason is None


def _joint(comp, x):
    """``(kvs, score_first)``: ``[kv | score]`` of ``x`` through one GEMM on ``comp``'s two
    linears' weights, or ``[score | kv]`` where its DDP parameter buffer holds ``wgate``
    right before ``wkv`` (the GEMM reads them in place: no concatenation a step)."""
    from .module import joint_projection_as_stored

    return joint_projection_as_stored(x, comp.linear_wkv.weight, comp.linear_wgate.weight)


def _forward_sbhd(self, x):
    """Megatron's ``Compressor._forward_sbhd`` with the pooling fused: ``x`` is
    ``(sq, b, hidden)``; returns ``(sq // ratio, b, head_dim)``, or None when ``sq < ratio``."""
    original, mod = _state["sbhd"], _state["module"]
    ratio = self.compress_ratio
    sq = x.size(0)
    if sq < ratio:
        return original(self, x)
    reason = _method_reason(self, x)
    if reason is not None:
        _fallback(reason)
        return original(self, x)
    joint, score_first = _projection_on(self), False
    with mod.get_fp8_disabled_context(self.config):
        if joint:
            (kv, score_first), score = _joint(self, x), None  # (sq, b, 2 * coff * head_dim)
        else:
            kv, _ = self.linear_wkv(x)  # (sq, b, coff * head_dim)
            score, _ = self.linear_wgate(x)
    from .dispatch import fused_sbhd_or_reason

    n, b = sq // ratio, x.shape[1]
    epilogue, fin = _epilogue_on(self, grouped=False), None
    if epilogue:
        from .epilogue import sbhd_positions

        positions = sbhd_positions(n, b, ratio, x.device)
        if kv.dtype == x.dtype:  # the pooling kernel runs it inside (the same bits)
            fin = _finish_for(self, positions)
    try:
        pooled, reason = fused_sbhd_or_reason(kv, score, self.ape, ratio=ratio, coff=self.coff,
                                              packed=joint, score_first=score_first,
                                              numerics=_state["numerics"], finish=fin)
    except (TypeError, ValueError) as exc:  # e.g. a mistyped kill switch
        pooled, reason = None, str(exc)
    if pooled is None:
        _fallback(reason)
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


def _forward_thd(self, x, cu_seqlens, max_seqlen_q=None, compressed_group_ids=None,
                 fixed_total_comp=None):
    """Megatron's ``Compressor._forward_thd``; its pre-grouped (context-parallel) calls with
    the pooling fused: ``x`` ``(G * ratio, 1, hidden)``, returns ``((G, 1, head_dim), None)``."""
    from .grouped import grouped_offsets

    mod = _state["module"]

    def eager():  # Megatron's own method, unchanged
        return _state["thd"](self, x, cu_seqlens, max_seqlen_q, compressed_group_ids,
                             fixed_total_comp)

    ids = compressed_group_ids
    if ids is None and (_state["epilogue"] or _state["projection"]):
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
        _fallback(reason)
        return eager()
    ratio, G = self.compress_ratio, ids.numel()
    cu, cuc = grouped_offsets(ids.to(torch.int32), ratio)
    # The THD op itself, not compress_grouped: padding groups (ids < 0) take gradient like
    # Megatron's continuations do.
    if _projection_on(self):
        kvs, score_first = _joint(self, x)
        pooled = _fused_or_fallback(kvs.view(G * ratio, -1), None, self.ape, cu, cuc, G, ratio,
                                    self.coff, packed=True, score_first=score_first)
    else:
        kv, _ = self.linear_wkv(x)  # (G * ratio, 1, coff * head_dim)
        score, _ = self.linear_wgate(x)
        pooled = _fused_or_fallback(kv.view(G * ratio, -1), score.view(G * ratio, -1),
                                    self.ape, cu, cuc, G, ratio, self.coff)
    if pooled is None:
        return eager()
    if _epilogue_on(self, grouped=True):
        from .epilogue import grouped_positions

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
    from .epilogue import rope_positions
    from .layout import compressed_cu_seqlens

    # where the pooling cannot be fused, Megatron's method asks the hook, which says why
    if _method_reason(self, x) is not None or max_seqlen_q is None:
        return eager()
    fused_epilogue, joint = _epilogue_on(self, grouped=False), _projection_on(self)
    if not (fused_epilogue or joint):
        return eager()
    ratio, mod = self.compress_ratio, _state["module"]
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


def install(respect_enabled: bool = False, epilogue: bool = False,
            projection: bool = False, numerics: str = "fp32") -> None:
    """Route Megatron's Compressor through the fused kernels (idempotent). ``epilogue``: its
    norm, RoPE and rotation too (fp32 math, one rounding), not only the pooling.
    ``projection``: its two linears as one GEMM. ``numerics``: the fused pooling's, "fp32"
    (what Megatron's own fused path computes) or "eager" (rounded as its eager region
    rounds: alone, Megatron's Compressor then computes what it does without fused kernels)."""
    from .validation import check_pool_numerics

    for name, value in (("respect_enabled", respect_enabled), ("epilogue", epilogue),
                        ("projection", projection)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {value!r}")
    check_pool_numerics(numerics)
    mod = _csa_module()
    if _state["module"] is None:
        _state["module"], _state["original"] = mod, getattr(mod, HOOK)
        _state["sbhd"] = getattr(mod.Compressor, "_forward_sbhd", None)
        _state["thd"] = getattr(mod.Compressor, "_forward_thd", None)
    _state["respect_enabled"], _state["epilogue"] = respect_enabled, epilogue
    _state["projection"], _state["numerics"] = projection, numerics
    setattr(mod, HOOK, maybe_compress_thd_fused)
    if _state["sbhd"] is not None:
        mod.Compressor._forward_sbhd = _forward_sbhd
    if _state["thd"] is not None:
        mod.Compressor._forward_thd = _forward_thd


def uninstall() -> None:
    """Restore Megatron's own hook (a no-op when not installed)."""
    if _state["module"] is not None:
        setattr(_state["module"], HOOK, _state["original"])
        for name in ("sbhd", "thd"):
            if _state[name] is not None:
                setattr(_state["module"].Compressor, f"_forward_{name}", _state[name])
        _state["module"] = _state["original"] = _state["sbhd"] = _state["thd"] = None
        _state["epilogue"] = _state["projection"] = False
        _state["numerics"] = "fp32"


def is_installed() -> bool:
    return _state["module"] is not None


@contextlib.contextmanager
def installed(respect_enabled: bool = False, epilogue: bool = False, projection: bool = False,
              numerics: str = "fp32"):
    """``install()`` for the block, then Megatron's hook back as it was."""
    flags = ("respect_enabled", "epilogue", "projection", "numerics")
    was, before = is_installed(), [_state[f] for f in flags]
    install(respect_enabled, epilogue, projection, numerics)
    try:
        yield
    finally:
        if was:
            for f, v in zip(flags, before):
                _state[f] = v
        else:
            uninstall()
