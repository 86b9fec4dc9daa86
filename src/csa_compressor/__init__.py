"""Fused gated softmax pooling of the DeepSeek-V4-style Compressor over packed sequences.

Public surface:
- ``compress_thd_fused``: the fused op (autograd, torch.compile, CUDA graphs);
  ``compress_thd_fused_packed`` the same on ``[kv | score]`` as one tensor (one projection).
- ``compress_sbhd_fused`` / ``compress_sbhd_fused_packed``: the same on ``(S, B, ...)``
  inputs, read in place.
- ``compress_grouped``: the same on rows already packed in groups (context parallel).
- ``pool_forward`` / ``pool_backward`` / ``backward_workspace_shape``: kernel-level API
  with caller-provided buffers.
- ``precompile``: compile ahead of time (before CUDA-graph capture).
- ``maybe_compress_thd_fused`` / ``fused_unavailable_reason``: dispatch with fallback.
- ``Compressor``: the whole Compressor block as an ``nn.Module``.
- ``Epilogue`` / ``apply_epilogue``: RMSNorm, RoPE and Hadamard rotation after the pooling,
  one autograd node; ``YaRN``: DeepSeek-V4's rotary frequency scaling;
  ``set_epilogue_inside``: which directions of the pooling + epilogue op run as one kernel.
- ``megatron`` (import it): route Megatron-LM's Compressor through the fused kernels.
- ``reference``: the plain-PyTorch references (``compress_thd``, ``compress_sbhd``).
- ``compressed_cu_seqlens`` / ``compressed_capacity``: THD layout helpers.

Names load on first use, so ``python -m csa_compressor --help`` needs no torch import.
"""

import importlib

__version__ = "0.1.0"

_WHERE = {
    "Compressor": "module", "Epilogue": "epilogue", "YaRN": "epilogue",
    "apply_epilogue": "epilogue",
    "backward_workspace_shape": "kernels", "pool_backward": "kernels",
    "pool_forward": "kernels", "precompile": "kernels",
    "compress_thd_fused": "ops", "compress_thd_fused_packed": "ops", "compress_grouped": "grouped",
    "compress_sbhd_fused": "ops", "compress_sbhd_fused_packed": "ops",
    "compressed_capacity": "layout", "compressed_cu_seqlens": "layout",
    "fused_unavailable_reason": "dispatch", "maybe_compress_thd_fused": "dispatch",
    "set_epilogue_inside": "fused_epilogue",
}
__all__ = sorted([*_WHERE, "reference"])


def __getattr__(name):
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    if name in _WHERE:
        value = getattr(importlib.import_module("." + _WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
