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
        tars = glob.glob(os.path.join(ROOT, "..", "shared", "megatron", "*.tar.xz"))
        # the dev snapshot first, then the overlays (the V4.1 compressor) on top of it
        tars.sort(key=lambda t: (os.path.basename(t).startswith("megatron-lm-dev") is False, t))
        if tars:
            path = tempfile.mkdtemp(prefix="megatron-lm-")
            for t in tars:
                with tarfile.open(t) as tar:
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


def import_csa2():
    """Megatron's DeepSeek-V4.1 compressor module (the csa2 overlay), or None."""
    if import_csa() is None:
        return None
    try:
        import megatron.core.transformer.experimental_attention_variant.csa2.compressor as csa2
    except Exception:  # a tree without the overlay: the tests that need it skip
        return None
    return csa2


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


def epilogue_by_hand(mg, x, path, pooling, total=None, cu=None, max_seqlen=None, ids=None,
                     joint=False):
    """What install(epilogue=True) computes, composed by hand from other parts: Megatron's
    projections, the pooling (``pooling``: "reference", the fp32 reference that stands in for
    the kernels on a CPU, or "fused", the package's op), eager_epilogue with
    Megatron's norm weight and eps and a rotary table cut from Megatron's own
    (``mg.rotary_pos_emb``), at Megatron's positions. ``joint``: the projections as one
    GEMM on the two weights' concatenation, the pooling on its halves; "score_first": the
    concatenation ``[wgate; wkv]`` and the pooling on ``[score | kv]``. Returns the output."""
    import csa_compressor as C
    from csa_compressor import reference
    from csa_compressor.epilogue import (Epilogue, eager_epilogue, grouped_positions,
                                         rope_positions, sbhd_positions)
    from csa_compressor.grouped import grouped_offsets
    from csa_compressor.layout import compressed_cu_seqlens

    ratio, coff, d, r = mg.compress_ratio, mg.coff, mg.head_dim, mg.qk_pos_emb_head_dim
    kvs, score_first = None, joint == "score_first"
    if joint:  # the fused ops read its halves in place (the packed forms)
        ws = (mg.linear_wkv.weight, mg.linear_wgate.weight)
        kvs = torch.nn.functional.linear(x, torch.cat(ws[::-1] if score_first else ws))
        kv, score = kvs[..., : coff * d], kvs[..., coff * d:]
        if score_first:
            kv, score = score, kv
    else:
        kv, score = mg.linear_wkv(x)[0], mg.linear_wgate(x)[0]
    kw = dict(ratio=ratio, coff=coff)
    pk = dict(kw, score_first=score_first)
    fused = pooling == "fused"
    if path == "sbhd":
        if fused:
            pooled = (C.compress_sbhd_fused(kv, score, mg.ape, **kw) if kvs is None
                      else C.compress_sbhd_fused_packed(kvs, mg.ape, **pk))
        else:
            pooled = reference.compress_sbhd(kv, score, mg.ape, **kw, mode="fp32")
        n, b = pooled.shape[:2]
        rows, pos = pooled.reshape(n * b, d), sbhd_positions(n, b, ratio, x.device)
    else:
        kv, score = kv.reshape(kv.shape[0], -1), score.reshape(score.shape[0], -1)
        if path == "grouped":
            cu, cuc = grouped_offsets(ids, ratio)
            total, pos = ids.numel(), grouped_positions(ids, ratio)
        else:
            cuc = compressed_cu_seqlens(cu, ratio)
            pos = rope_positions(cuc, total, ratio, max_seqlen)
        if not fused:
            rows = reference.compress_thd(kv, score, mg.ape, cu, cuc, total, **kw, mode="fp32")
        elif kvs is None:
            rows = C.compress_thd_fused(kv, score, mg.ape, cu, cuc, total, **kw)
        else:
            rows = C.compress_thd_fused_packed(kvs.reshape(kvs.shape[0], -1), mg.ape, cu, cuc,
                                               total, **pk)
    table = None
    if r:
        emb = mg.rotary_pos_emb(int(pos.max()) + 1, packed_seq=True)
        ang = (emb[0] if isinstance(emb, tuple) else emb)[:, 0, 0, : r // 2]
        table = (torch.cos(ang), torch.sin(ang))
    ep = Epilogue(eps=mg.norm.eps, rope_dim=r, rope_interleaved=True, rotate=mg.rotate)
    out = eager_epilogue(rows, mg.norm.weight, pos, ep, rope_table=table)
    return out.view(n, b, d) if path == "sbhd" else out.unsqueeze(1)


def megatron_ddp(mod, config=None):
    """Megatron's own DistributedDataParallel (the distributed optimizer's layout) around
    ``mod`` (``config``: a Megatron TransformerConfig, default ``mod.config``): its
    parameters become views of DDP's flat buffers, in the reverse of their registration
    order (``linear_wgate``'s weight right before ``linear_wkv``'s, the package module's
    ``wgate`` before ``wkv``), and their gradients land in ``main_grad``. Returns the
    wrapper."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    return DistributedDataParallel(config or mod.config, cfg, mod)


def inside_and_outside_ddp(ddp, mod, twin, x, forward, gen):
    """One forward + backward of ``mod`` under ``ddp`` and of ``twin`` (its copy outside
    DDP) with one random incoming gradient from ``gen``: for each, [output, input gradient,
    every parameter's gradient (main_grad inside; fp32)]."""
    ddp.zero_grad_buffer()
    xi = x.clone().requires_grad_(True)
    out = forward(mod, xi)
    g = torch.randn(out.shape, device=out.device, generator=gen).to(out.dtype)
    out.backward(g)
    inside = [out.detach(), xi.grad] + [p.main_grad for p in mod.parameters()]
    xa = x.clone().requires_grad_(True)
    out = forward(twin, xa)
    out.backward(g)
    return inside, [out.detach(), xa.grad] + [p.grad.float() for p in twin.parameters()]


def count_concatenations(monkeypatch):
    """A list that grows by one at each concatenation of the two projection weights
    (module.joint_projection, which the in-place GEMM on a buffer's ``[wgate; wkv]`` never
    calls)."""
    from csa_compressor import module

    calls, real = [], module.joint_projection
    monkeypatch.setattr(module, "joint_projection", lambda *a: calls.append(1) or real(*a))
    return calls


def ddp_step(ddp, mg, x, forward, g=None):
    """(output, input gradient, {name: main_grad}) of one forward + backward of ``mg`` under
    ``ddp``; ``g`` the incoming gradient (default: seeded random)."""
    ddp.zero_grad_buffer()
    mg.zero_grad(set_to_none=True)  # a gradient left from outside DDP would be added in
    xi = x.clone().requires_grad_(True)
    out = forward(mg, xi)
    if g is None:
        gen = torch.Generator(out.device.type).manual_seed(1)
        g = torch.randn(out.shape, device=out.device, generator=gen).to(out.dtype)
    out.backward(g)
    return out.detach(), xi.grad, {n: p.main_grad.clone() for n, p in mg.named_parameters()}


def bf16_ulps(a, b):
    """|a - b| in bf16 ulps of max(|b|, b's RMS over the last dim), fp32."""
    a, b = a.float(), b.float()
    rms = b.pow(2).mean(-1, keepdim=True).sqrt()
    ref = torch.maximum(b.abs(), rms).clamp_min(torch.finfo(torch.float32).tiny)
    return (a - b).abs() / (ref * 2.0 ** -7)


def sbhd_step(comp, x):
    """One SBHD forward + backward of a Compressor: (output, input gradient, {name:
    parameter gradient}), the incoming gradient random and the same for every call."""
    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = comp(x)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return (out.detach().float(), x.grad.float(),
            {n: p.grad.float() for n, p in comp.named_parameters()})


def grouped_step(comp, x, ids, max_seqlen, skip_row0):
    """One pre-grouped (context-parallel) forward + backward of Megatron's Compressor. Row 0
    takes no gradient where it is the previous rank's halo (ids[0] != 0), as downstream."""
    comp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    cu = torch.tensor([0, x.shape[0]], dtype=torch.int32)
    out, second = comp._forward_thd(x, cu, max_seqlen_q=max_seqlen, compressed_group_ids=ids)
    assert second is None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    if skip_row0:
        g[0] = 0
    out.backward(g)
    return (out.detach().float(), x.grad.float(),
            {n: p.grad.float() for n, p in comp.named_parameters()})
