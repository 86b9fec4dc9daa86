"""Fused gated softmax pooling of the DeepSeek-V4-style Compressor over packed sequences.

Public surface:
- ``compress_thd_fused``: the fused op (autograd, torch.compile, CUDA graphs).
- ``pool_forward`` / ``pool_backward``: kernel-level API with caller-provided buffers.
- ``precompile``: compile ahead of time (before CUDA-graph capture).
- ``maybe_compress_thd_fused`` / ``fused_unavailable_reason``: dispatch with fallback.
- ``Compressor``: the whole Compressor block as an ``nn.Module``.
- ``reference``: the plain-PyTorch references (``compress_thd``, ``compress_sbhd``).
- ``compressed_cu_seqlens`` / ``compressed_capacity``: THD layout helpers.
"""

from . import reference
from .kernels import backward_workspace_shape, pool_backward, pool_forward, precompile
from .module import Compressor
from .layout import compressed_capacity, compressed_cu_seqlens
from .ops import compress_thd_fused
from .dispatch import fused_unavailable_reason, maybe_compress_thd_fused

__version__ = "0.1.0"
__all__ = [
    "Compressor",
    "backward_workspace_shape", "compress_thd_fused", "compressed_capacity",
    "compressed_cu_seqlens", "fused_unavailable_reason", "maybe_compress_thd_fused", "pool_backward", "pool_forward", "precompile", "reference",
]
