"""Whether the kernels can run here, and why not: the device, the kill switch, the DSL.

A leaf: the layout, the epilogue, the ops and the dispatch ask it from below; it imports
nothing of the package but the argument checks."""

from __future__ import annotations

import functools
import os

import torch

from .checks import env_flag


@functools.lru_cache(maxsize=1)
def dsl_import_error() -> str | None:
    """None when the CuTe DSL and TVM-FFI import, else a one-line reason."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"CuTe DSL unavailable ({type(exc).__name__}: {exc})"
    return None


KILL_SWITCH = "CSA_COMPRESSOR_FUSED"
MIN_CAPABILITY = (9, 0)


def device_reason(device: torch.device):
    """A reason this device cannot run the kernels at all, or None."""
    return device_reason_const(device.type, device.index)


# (device type, index) -> probe_device's answer: it cannot change in a process, and the
# CUDA queries behind it cost host time several times a step outside CUDA graphs.
DEVICE_REASONS: dict = {}


# Depends only on the device and the installed packages: torch.compile may treat it as a
# constant instead of tracing CUDA queries (no graph break under fullgraph=True).
@torch._dynamo.assume_constant_result
def device_reason_const(device_type: str, index):
    key = (device_type, index)
    try:
        return DEVICE_REASONS[key]
    except KeyError:
        pass
    reason = probe_device(device_type, index)
    if device_type != "cuda" or index is not None:  # "cuda" alone: whichever device is current
        DEVICE_REASONS[key] = reason
    return reason


def probe_device(device_type: str, index):
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
def kill_switch_reason():
    if not env_flag(KILL_SWITCH, True):  # an unknown value raises: a typo is not "on"
        return f"disabled by the environment ({KILL_SWITCH}={os.environ[KILL_SWITCH]})"
    return None


def small_kernels_usable(t: torch.Tensor) -> bool:
    """Whether the small kernels beside the pooling (the epilogue's rows, the compressed
    offsets, the rotary positions and angles: each the same integers and bits as the torch
    ops it stands in for) run on ``t``'s device: a device the pooling kernels run on, the
    kill switch not set, outside torch.compile (which fuses those ops itself)."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return False
    return device_reason(t.device) is None and kill_switch_reason() is None
