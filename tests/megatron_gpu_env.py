"""What the Megatron-LM GPU tests share (tests/test_megatron_gpu.py, _numerics_gpu.py,
_epilogue_gpu.py): a fresh fallback-reason record for each test, steps with the adapter
installed, the package's own steps, and the inputs of Megatron's Compressor paths."""

import pytest
import torch

from csa_compressor import megatron


@pytest.fixture
def fresh_fallback_reasons():
    """Each test reads the reasons its own calls recorded."""
    megatron.clear_fallback_reasons()


def installed_step(step, monkeypatch):
    """``step()`` with the adapter installed, and the row counts the fused pooling ran on
    (an SBHD launch's: every sequence's)."""
    from csa_compressor import dispatch

    fused, launched = dispatch.fused_from_validated, []
    monkeypatch.setattr(dispatch, "fused_from_validated",
                        lambda p, *a, **k: launched.append(p.total_comp * max(p.batch, 1))
                        or fused(p, *a, **k))
    with megatron.installed():
        return step(), launched


def sbhd_step(comp, x):
    """One SBHD forward + backward of ``comp``: (output, input gradient, {parameter name:
    gradient}), in fp32."""
    comp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = comp(xi)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    out.backward(g.to(out.dtype))
    return out.float(), xi.grad.float(), {n: p.grad.float() for n, p in comp.named_parameters()}


def ours_thd_step(ours, x, cu, max_seqlen):
    """One THD forward + backward of the package's Compressor with thd_step's incoming
    gradient: (output, input gradient, {parameter name: gradient}), in fp32."""
    xs = x.clone().requires_grad_(True)
    out, cuc = ours(xs, cu, max_seqlen=max_seqlen)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    g = g.to(out.dtype)
    g[int(cuc[-1]):] = 0
    out.backward(g)
    return (out.detach().float(), xs.grad.float(),
            {n: p.grad.float() for n, p in ours.named_parameters()})


def path_case(path, ratio, hidden):
    """The input of one of Megatron's Compressor paths at the GPU tests' scale (THD 8192 +
    8191 + 5000 + 3 + 0 tokens with capacity padding, SBHD 2 x 4100, pre-grouped 8192
    tokens as groups with a halo, continuations and padding), epilogue_by_hand's extra
    arguments for it, and its forward ``(module, x) -> output``."""
    gen = torch.Generator("cuda").manual_seed(2)
    if path == "thd":
        lens = [8192, 8191, 5000, 3, 0]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device="cuda")
        x = torch.randn(int(cu[-1]), 1, hidden, device="cuda", generator=gen).to(torch.bfloat16)

        def forward(comp, xi):
            from megatron.core.packed_seq_params import PackedSeqParams

            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            return comp(xi, psp)[0]
        return x, dict(cu=cu, max_seqlen=max(lens)), forward
    if path == "sbhd":
        x = torch.randn(4100, 2, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        return x, {}, lambda comp, xi: comp(xi)
    n = 8192 // ratio
    ids = torch.cat([torch.arange(5, n // 2), torch.arange(n // 2 - 7),
                     torch.full((7,), -1)]).to(device="cuda", dtype=torch.int32)
    x = torch.randn(ids.numel() * ratio, 1, hidden, device="cuda",
                    generator=gen).to(torch.bfloat16)

    def forward(comp, xi):
        cu1 = torch.tensor([0, xi.shape[0]], dtype=torch.int32, device="cuda")
        return comp._forward_thd(xi, cu1, max_seqlen_q=8192, compressed_group_ids=ids)[0]
    return x, dict(ids=ids, max_seqlen=8192), forward


def hooked_step(megatron_csa, step):
    """``step()`` with the adapter installed, and what each call of Megatron's THD hook
    gave: True where the fused pooling answered it."""
    calls = []
    hook = megatron.maybe_compress_thd_fused

    def counted(*a, **k):
        out = hook(*a, **k)
        calls.append(out is not None)
        return out

    with megatron.installed():
        megatron_csa.maybe_compress_thd_fused = counted
        return step(), calls
