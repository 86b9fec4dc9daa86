"""Fused gated softmax pooling of the DeepSeek-V4-style Compressor over packed sequences.

Public surface (``__all__``):
- ``compress_thd_fused`` / ``compress_thd_fused_packed``: the fused op on THD packs (kv and
  score apart, or as the halves of one tensor), with the epilogue where asked.
- ``compress_sbhd_fused`` / ``compress_sbhd_fused_packed``: the same on ``(S, B, ...)``.
- ``compress_grouped``: the same on rows already packed in groups (context parallel).
- ``maybe_compress_thd_fused`` / ``fused_unavailable_reason``: dispatch with fallback.
- ``Compressor``: the whole Compressor block as an ``nn.Module``.
- ``Epilogue`` / ``EpilogueInside`` / ``apply_epilogue``: RMSNorm, RoPE and rotation after
  the pooling, which directions of it run inside the pooling kernels, the node alone.
- ``compressed_cu_seqlens``: the THD offsets of the compressed rows.

Submodules: ``kernel_api`` (caller buffers: ``PoolPlan``, ``pool_forward``, ``pool_backward``,
``backward_workspace_shape``, ``precompile``), ``reference`` (plain PyTorch), ``layout``,
``epilogue`` (``YaRN``), ``megatron`` (Megatron-LM's Compressor on the fused kernels),
``streaming`` (prefill / decode for generation), ``transformers`` (Hugging Face's
DeepSeek-V4 compressors on the fused kernels).

Names load on first use, so ``csa-compressor --help`` needs no torch import.
"""

import importlib
import warnings

__version__ = "0.2.0"

_WHERE = {
    "Compressor": "module", "Epilogue": "epilogue", "EpilogueInside": "fused_epilogue",
    "apply_epilogue": "epilogue_op",
    "compress_thd_fused": "ops", "compress_thd_fused_packed": "ops", "compress_grouped": "grouped",
    "compress_sbhd_fused": "ops", "compress_sbhd_fused_packed": "ops",
    "compressed_cu_seqlens": "layout",
    "fused_unavailable_reason": "dispatch", "maybe_compress_thd_fused": "dispatch",
}
# Names of the 0.1 surface that moved: they work for this release with a warning.
_MOVED = {
    "YaRN": "epilogue", "backward_workspace_shape": "kernel_api", "pool_backward": "kernel_api",
    "pool_forward": "kernel_api", "precompile": "kernel_api", "compressed_capacity": "layout",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module("." + _WHERE[name], __name__), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        warnings.warn(f"csa_compressor.{name} is deprecated: use csa_compressor.{_MOVED[name]}."
                      f"{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("." + _MOVED[name], __name__), name)
    if name == "set_epilogue_inside":
        raise AttributeError("csa_compressor.set_epilogue_inside was removed: pass "
                             "epilogue_inside=csa_compressor.EpilogueInside(short=..., long=...) "
                             "to the op or the Compressor instead")
    if name in ("reference", "kernel_api", "layout", "epilogue", "megatron", "streaming",
                "transformers"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
