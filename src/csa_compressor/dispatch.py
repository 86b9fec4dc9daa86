"""Dispatch: the fused result when it can run, else ``None`` so the caller runs its eager code."""

from __future__ import annotations

import logging
import os

import torch

from .kernels.compile import dsl_import_error
from .validation import validate

KILL_SWITCH = "CSA_COMPRESSOR_FUSED"
MIN_CAPABILITY = (9, 0)
_log = logging.getLogger("csa_compressor")
_logged: set = set()


def _device_reason(device: torch.device):
    """A reason this device cannot run the kernels at all, or None."""
    return _device_reason_const(device.type, device.index)


# Depends only on the device and the installed packages: torch.compile may treat it as a
# constant instead of tracing CUDA queries (no graph break under fullgraph=True).
@torch._dynamo.assume_constant_result
def _device_reason_const(device_type: str, index):
    device = torch.device(device_type, index)
    if device.type != "cuda":
        return f"tensors are on {device}, the fused kernels need a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA GPU available"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"compute capability {cap[0]}.{cap[1]} of {device} is below "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Hopper)")
    return dsl_import_error()


@torch._dynamo.assume_constant_result
def _kill_switch_reason():
    value = os.environ.get(KILL_SWITCH, "1")
    if value.strip().lower() in ("0", "false", "off", "no"):
        return f"disabled by the environment ({KILL_SWITCH}={value})"
    return None


def fused_unavailable_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                             enabled: bool = True):
    """None when the fused kernels would run on these arguments, else a one-line reason."""
    reason = _kill_switch_reason()
    if reason:
        return reason
    if not enabled:
        return "disabled by the caller (enabled=False)"
    device = getattr(kv, "device", None)
    if device is not None:
        reason = _device_reason(device)
        if reason:
            return reason
    try:
        validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio, coff=coff,
                 for_kernel=True)
    except (TypeError, ValueError) as exc:
        return f"unsupported input: {exc}"
    return None


def maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                             enabled: bool = True):
    """The fused pooling, or ``None`` with the reason logged once (when a capable GPU was
    passed over) so the caller runs its own eager region."""
    reason = fused_unavailable_reason(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp,
                                      ratio=ratio, coff=coff, enabled=enabled)
    if reason is None:
        from .ops import compress_thd_fused

        return compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp,
                                  ratio=ratio, coff=coff)
    device = getattr(kv, "device", None)
    capable = device is not None and _device_reason(device) is None
    if capable and reason not in _logged:
        _logged.add(reason)
        _log.warning("csa_compressor: falling back to eager pooling: %s", reason)
    return None
