"""Dispatch: the fused result when it can run, else ``None`` so the caller runs its eager code."""

from __future__ import annotations

import logging

import torch

from .checks import check_flag, check_pool_numerics, halves
from . import ops, runtime
from .validation import (check_offset_contents, offsets_check_requested, sbhd_rows_aligned, validate,
                         validate_packed, validate_sbhd)

_log = logging.getLogger("csa_compressor")
_logged: set = set()


def unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, enabled,
                 packed=False, sbhd=False, score_first=False):
    """(reason or None, the validated problem where there is no reason). ``packed``: ``kv``
    is the packed ``kvs`` of validate_packed (``[score | kv]`` where ``score_first``) and
    ``score`` is None; ``sbhd``: the inputs are validate_sbhd's (the offsets and total_comp
    unused)."""
    check_flag("enabled", enabled)
    reason = runtime.kill_switch_reason()
    if reason:
        return reason, None
    if not enabled:
        return "disabled by the caller (enabled=False)", None
    device = getattr(kv, "device", None)
    if device is not None:
        reason = runtime.device_reason(device)
        if reason:
            return reason, None
    try:
        if sbhd:
            p = validate_sbhd(kv, score, ape, ratio=ratio, coff=coff, for_kernel=True,
                              packed=packed, score_first=score_first)
        elif packed:
            p = validate_packed(kv, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                                coff=coff, for_kernel=True, contents=False,
                                score_first=score_first)
        else:
            p = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                         coff=coff, for_kernel=True, contents=False)
    except (TypeError, ValueError) as exc:
        return f"unsupported input: {exc}", None
    return None, p


def fused_unavailable_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                             enabled: bool = True):
    """None when the fused kernels would run on these arguments, else a one-line reason.
    Offsets' contents are not read here (maybe_compress_thd_fused's check_offsets)."""
    return unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                        enabled)[0]


def fused_from_validated(p, check_offsets: bool = False, numerics: str = "fp32", finish=None):
    """The fused pooling of a problem _unavailable validated (contents unread): the offsets
    checked first where asked (argument or CSA_COMPRESSOR_CHECK_OFFSETS); with a
    ``finish`` (fused_epilogue.Finish) the epilogue's output."""
    if offsets_check_requested(check_offsets):
        check_offset_contents(p)
    p.numerics = numerics  # checked by the callers' entry points
    return ops.fused_from_problem(p, finish)


def fused_or_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                    enabled: bool = True, check_offsets: bool = False, numerics: str = "fp32",
                    finish=None):
    """(the fused pooling, None) or (None, the reason): validation runs once. The offsets'
    contents are checked when asked (argument or CSA_COMPRESSOR_CHECK_OFFSETS) on either
    path, raising on bad ones. ``numerics``: compress_thd_fused's. ``finish``
    (fused_epilogue.Finish): the fused path's rows go on through the epilogue."""
    return _fused_or_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                            enabled, check_offsets, numerics=numerics, finish=finish)


def fused_packed_or_reason(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                           enabled: bool = True, check_offsets: bool = False,
                           score_first: bool = False, numerics: str = "fp32", finish=None):
    """fused_or_reason for ``[kv | score]`` (``[score | kv]`` where ``score_first``) as one
    tensor (compress_thd_fused_packed)."""
    return _fused_or_reason(kvs, None, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                            enabled, check_offsets, packed=True, score_first=score_first,
                            numerics=numerics, finish=finish)


def fused_sbhd_or_reason(kv, score, ape, *, ratio, coff, packed: bool = False,
                         enabled: bool = True, score_first: bool = False,
                         numerics: str = "fp32", finish=None):
    """(the fused SBHD pooling ``(S // ratio, B, d)``, None) or (None, the reason): for
    compress_sbhd_fused's inputs, or compress_sbhd_fused_packed's where ``packed`` (``kv``
    is ``kvs``, ``[score | kv]`` where ``score_first``, and ``score`` None). Rows the
    kernels cannot read in place (``coff*d`` or ``d`` times the element size not a multiple
    of 16 bytes) take one transposed copy into the THD layout and the THD op instead.
    ``finish``: as fused_or_reason's."""
    check_pool_numerics(numerics)
    reason, p = unavailable(kv, score, ape, None, None, 0, ratio, coff, enabled, packed,
                             sbhd=True, score_first=score_first)
    if reason is None:
        return fused_from_validated(p, numerics=numerics, finish=finish), None
    if reason.startswith("unsupported input"):
        try:  # the inputs themselves are fine: only their rows are not 16-byte multiples?
            p = validate_sbhd(kv, score, ape, ratio=ratio, coff=coff, packed=packed,
                              score_first=score_first)
        except (TypeError, ValueError):
            return None, reason
        if sbhd_rows_aligned(p.kv.shape[1], coff, p.kv.element_size()):
            return None, reason
        kv, score = p.full or halves(p.kvs, p.score_first)
        S, B, W = kv.shape
        n = S // ratio
        steps = torch.arange(B + 1, dtype=torch.int32, device=kv.device)
        out, reason = _fused_or_reason(kv.transpose(0, 1).reshape(B * S, W),
                                       score.transpose(0, 1).reshape(B * S, W), ape, steps * S,
                                       steps * n, B * n, ratio, coff, enabled, False,
                                       numerics=numerics)
        if reason is None:
            out = out.view(B, n, -1).transpose(0, 1)
            return (out if finish is None else finish.check(p).apply(out)), None
    return None, reason


def _fused_or_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, enabled,
                     check_offsets, packed=False, score_first=False, numerics="fp32", finish=None):
    check_pool_numerics(numerics)
    reason, p = unavailable(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio,
                             coff, enabled, packed, score_first=score_first)
    if reason is None:
        return fused_from_validated(p, check_offsets, numerics, finish), None
    if offsets_check_requested(check_offsets) and not reason.startswith("unsupported input"):
        # the fallback would compute the same wrong rows: the contents are checked either way
        if packed:
            validate_packed(kv, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                            coff=coff, check_offsets=True, score_first=score_first)
        else:
            validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                     coff=coff, check_offsets=True)
    return None, reason


def maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                             enabled: bool = True, check_offsets: bool = False,
                             numerics: str = "fp32"):
    """The fused pooling, or ``None`` with the reason logged once (when a capable GPU was
    passed over) so the caller runs its own eager region. ``check_offsets`` (or
    CSA_COMPRESSOR_CHECK_OFFSETS=1) checks the offsets' contents either way and raises on
    bad ones: a fallback would compute the same wrong rows."""
    out, reason = fused_or_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp,
                                  ratio=ratio, coff=coff, enabled=enabled,
                                  check_offsets=check_offsets, numerics=numerics)
    if reason is None:
        return out
    device = getattr(kv, "device", None)
    capable = device is not None and runtime.device_reason(device) is None
    if capable and reason not in _logged:
        _logged.add(reason)
        _log.warning("csa_compressor: falling back to eager pooling: %s", reason)
    return None
