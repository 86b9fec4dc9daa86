"""Inputs shared by the tests, the bench, the numerics gate and the developer tools:
random packs for a ``shapes.Shape`` (never zeros, which hide unwritten outputs)."""

from __future__ import annotations

import torch

from .layout import compressed_capacity, compressed_cu_seqlens
from .shapes import Shape, parse_shape  # noqa: F401  (re-exported for the tools)


def make_inputs(shape: Shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    T, W = sum(shape.lens), shape.coff * shape.d
    kv = torch.randn(T, W, device=device, dtype=torch.float32, generator=gen).to(dtype)
    score = (2 * torch.randn(T, W, device=device, generator=gen)).to(dtype)
    ape = torch.randn(shape.ratio, W, device=device, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(shape.lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    cuc = compressed_cu_seqlens(cu, shape.ratio)
    # Static capacity, as a CUDA-graph training step would pass it (no host sync).
    N = compressed_capacity(T, len(shape.lens), max(shape.lens), shape.ratio)
    g = torch.randn(N, shape.d, device=device, generator=gen).to(dtype)
    return kv, score, ape, cu, cuc, N, g


# Megatron-LM's own Compressor, for the tests that drive it and tools/megatron_bench.py
# (Megatron imported only here, when called).

def megatron_one_process(tmp_dir):
    """A one-process gloo group and model parallel sizes 1 (what the Compressor asks of)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def megatron_compressor(csa, hidden, head_dim, ratio, rope_dim, rotate=False, seed=0,
                        dtype=torch.float32, yarn=None):
    """Megatron's Compressor (fp32 unless ``dtype``): ColumnParallelLinear projections (tensor parallel 1)
    and WrappedTorchNorm, as the Transformer-Engine-free spec would give. On a CPU the
    caller points torch.cuda.current_device at the CPU (Megatron allocates there)."""
    from megatron.core.models.common.embeddings import RotaryEmbedding
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class Linear(ColumnParallelLinear):  # TE's keyword arguments, which it does not take
        def __init__(self, *args, parallel_mode=None, name=None, **kwargs):
            super().__init__(*args, **kwargs)

    torch.manual_seed(seed)
    cfg = MLATransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                               qk_pos_emb_head_dim=rope_dim, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16)
    sub = csa.CompressorSubmodules(linear_wkv=Linear, linear_wgate=Linear, norm=WrappedTorchNorm)
    if yarn is None:
        rope = RotaryEmbedding(kv_channels=rope_dim, rotary_percent=1.0)
    else:  # {scaling_factor, original_max_position_embeddings, beta_fast, beta_slow}
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            YarnRotaryEmbedding)

        # its tables made where Megatron's default config makes them (the GPU where there is one)
        rope = YarnRotaryEmbedding(kv_channels=rope_dim, rotary_percent=1.0,
                                   use_cpu_initialization=not torch.cuda.is_available(), **yarn)
    return csa.Compressor(cfg, sub, compress_ratio=ratio, head_dim=head_dim, rotate=rotate,
                          rotary_pos_emb=rope)
