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

from csa_compressor.testing import megatron_compressor, megatron_one_process

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
    megatron_one_process(tmp_dir)


build_compressor = megatron_compressor


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
