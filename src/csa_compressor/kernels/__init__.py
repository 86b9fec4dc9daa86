"""CuTe-DSL kernels of the gated pooling: forward and backward, with their compile cache."""

from .compile import precompile
from .launch import backward_workspace_shape, pool_backward, pool_forward

__all__ = ["backward_workspace_shape", "pool_backward", "pool_forward", "precompile"]
