"""Megatron-LM's own Compressor for tests: the tree from MEGATRON_LM_PATH, else the
snapshot tarball beside the project (../shared/megatron/*.tar.xz, unpacked once into a
temporary folder); None where neither is there or Megatron cannot import (it needs numpy,
packaging and triton)."""

import glob
import os
import sys
import tarfile
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_tree = {}


def megatron_tree():
    if "path" in _tree:
        return _tree["path"]
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        tars = sorted(glob.glob(os.path.join(ROOT, "..", "shared", "megatron", "*.tar.xz")))
        if tars:
            path = tempfile.mkdtemp(prefix="megatron-lm-")
            with tarfile.open(tars[-1]) as tar:
                tar.extractall(path, filter="data")
    _tree["path"] = path if path and os.path.isdir(os.path.join(path, "megatron")) else None
    return _tree["path"]


def import_csa():
    """Megatron's csa module, or None."""
    path = megatron_tree()
    if path is None:
        return None
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import megatron.core.transformer.experimental_attention_variant.csa as csa
    except Exception:  # an incomplete environment: the tests that need it skip
        return None
    return csa


def init_one_process(tmp_dir):
    """A one-process gloo group and model parallel sizes 1 (what the Compressor asks of)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build_compressor(csa, hidden, head_dim, ratio, rope_dim, rotate=False, seed=0,
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

        rope = YarnRotaryEmbedding(kv_channels=rope_dim, rotary_percent=1.0,
                                   use_cpu_initialization=True, **yarn)
    return csa.Compressor(cfg, sub, compress_ratio=ratio, head_dim=head_dim, rotate=rotate,
                          rotary_pos_emb=rope)


def thd_step(comp, x, cu, max_seqlen):
    """One THD forward + backward of Megatron's Compressor: (output, input gradient,
    parameter gradients). The incoming gradient is random on the true rows and zero on the
    capacity padding rows, which get none downstream (Megatron's eager region would pass
    one to token 0; the fused op ignores it)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    out, cuc = comp(x, psp)
    gen = torch.Generator(out.device.type).manual_seed(1)
    g = torch.randn(out.shape, device=out.device, generator=gen).to(out.dtype)
    g[int(cuc[-1]):] = 0
    out.backward(g)
    return (out.detach().float(), x.grad.float(),
            {n: p.grad.float() for n, p in comp.named_parameters()})
