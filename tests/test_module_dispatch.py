"""Dispatch reasons, the Compressor module on the reference path, RoPE positions (CPU)."""

import math

import pytest
import torch
from csa_compressor import runtime

import csa_compressor as C
from csa_compressor import dispatch
from csa_compressor.epilogue import apply_rope, hadamard
from packs import make_pack


def args():
    kv, score, ape, cu, cuc, N = make_pack([8, 5], 4, 4, 2)
    return (kv, score, ape, cu, cuc, N)


def test_reason_cpu_tensors():
    r = C.fused_unavailable_reason(*args(), ratio=4, coff=2)
    assert r is not None and "need a CUDA device" in r
    assert C.maybe_compress_thd_fused(*args(), ratio=4, coff=2) is None


def test_reason_kill_switch(monkeypatch):
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", "0")
    assert "CSA_COMPRESSOR_FUSED=0" in C.fused_unavailable_reason(*args(), ratio=4, coff=2)


def test_the_small_kernels_follow_the_pooling_rules(monkeypatch):
    """runtime.small_kernels_usable: a CUDA tensor on a device the pooling runs on, the
    kill switch unset, outside torch.compile; CPU tensors never (even where a test has
    passed over the device checks)."""
    from types import SimpleNamespace

    cuda_like = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "device_reason", lambda device: None)
    monkeypatch.delenv("CSA_COMPRESSOR_FUSED", raising=False)
    assert runtime.small_kernels_usable(cuda_like)
    assert not runtime.small_kernels_usable(torch.zeros(2))
    monkeypatch.setenv("CSA_COMPRESSOR_FUSED", "0")
    assert not runtime.small_kernels_usable(cuda_like)
    monkeypatch.delenv("CSA_COMPRESSOR_FUSED")
    monkeypatch.setattr(runtime, "device_reason", lambda device: "compute capability 8.0")
    assert not runtime.small_kernels_usable(cuda_like)
    monkeypatch.setattr(runtime, "device_reason", lambda device: None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not runtime.small_kernels_usable(cuda_like)


def test_reason_disabled_by_caller():
    assert "enabled=False" in C.fused_unavailable_reason(*args(), ratio=4, coff=2, enabled=False)


def test_reason_no_gpu_and_capability_and_dsl(monkeypatch):
    monkeypatch.setattr(runtime, "DEVICE_REASONS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.device_reason(torch.device("cuda", 0)) == "no CUDA GPU available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "DEVICE_REASONS", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert "below 9.0" in runtime.device_reason(torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "DEVICE_REASONS", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(runtime, "dsl_import_error", lambda: "CuTe DSL unavailable (test)")
    assert runtime.device_reason(torch.device("cuda", 0)) == "CuTe DSL unavailable (test)"


def test_a_devices_reason_is_found_once_and_kept(monkeypatch):
    calls = []

    def capability(d=None):
        calls.append(d)
        return (8, 0)

    monkeypatch.setattr(runtime, "DEVICE_REASONS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    first = [runtime.device_reason(torch.device("cuda", i)) for i in (0, 1, 0, 1)]
    assert all("below 9.0" in r for r in first)
    assert len(calls) == 2  # one query a device
    # "cuda" without an index means the current device, which may change: not kept
    runtime.device_reason(torch.device("cuda"))
    runtime.device_reason(torch.device("cuda"))
    assert len(calls) == 4


def test_reason_unsupported_input(monkeypatch):
    monkeypatch.setattr(runtime, "device_reason", lambda d: None)
    kv, score, ape, cu, cuc, N = args()
    r = C.fused_unavailable_reason(kv.double(), score.double(), ape, cu, cuc, N, ratio=4, coff=2)
    assert r.startswith("unsupported input: kv: expected dtype")
    r = C.fused_unavailable_reason(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    assert "need CUDA tensors" in r  # the kernel-only rules are part of the verdict


def naive_rope(x, pos, rope_dim, theta, interleaved):
    out = x.clone()
    d = x.shape[-1]
    for r in range(x.shape[0]):
        for k in range(rope_dim // 2):
            ang = float(pos[r]) * theta ** (-(2 * k) / rope_dim)
            c, s = math.cos(ang), math.sin(ang)
            i, j = (d - rope_dim + 2 * k, d - rope_dim + 2 * k + 1) if interleaved else \
                (d - rope_dim + k, d - rope_dim // 2 + k)
            out[r, i] = x[r, i] * c - x[r, j] * s
            out[r, j] = x[r, i] * s + x[r, j] * c
    return out


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_naive(interleaved):
    x = torch.randn(5, 12, dtype=torch.float64).float()
    pos = torch.tensor([0, 4, 8, 0, 4])
    got = apply_rope(x, pos, 8, 10000.0, interleaved)
    torch.testing.assert_close(got, naive_rope(x, pos, 8, 10000.0, interleaved), rtol=1e-5, atol=1e-5)


def test_hadamard_is_orthonormal():
    x = torch.randn(3, 16)
    h = hadamard(torch.eye(16))
    torch.testing.assert_close(h @ h.T, torch.eye(16), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hadamard(x), x @ h, rtol=1e-5, atol=1e-5)


def _naive_module(m, x, cu):
    """The Compressor pipeline spelt out per segment and block, for the positions."""
    kv, score = m.wkv(x), m.wgate(x)
    cuc = C.compressed_cu_seqlens(cu, m.ratio)
    N = int(cuc[-1])
    pooled = C.reference.compress_thd(kv, score, m.ape, cu, cuc, N, ratio=m.ratio, coff=m.coff)
    pos = []
    for s in range(cu.numel() - 1):
        pos += [i * m.ratio for i in range(int(cu[s + 1] - cu[s]) // m.ratio)]  # restart per segment
    y = pooled.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.norm_eps) * m.norm_weight.float()
    return naive_rope(y, torch.tensor(pos), m.rope_dim, m.rope_theta, m.rope_interleaved).to(pooled.dtype)


@pytest.mark.parametrize("ratio", [4, 128])
def test_module_thd_reference_path(ratio):
    torch.manual_seed(0)
    m = C.Compressor(32, 16, ratio, rope_dim=8, dtype=torch.float32)
    assert m.coff == (2 if ratio == 4 else 1)
    lens = [3 * ratio + 1, 0, ratio - 1, 2 * ratio]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lens), 32, requires_grad=True)
    y, cuc = m(x, cu)
    torch.testing.assert_close(y, _naive_module(m, x, cu), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    for p in m.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    y3, _ = m(x.detach().unsqueeze(1), cu, max_seqlen=max(lens))
    assert y3.shape[0] >= y.shape[0]
    torch.testing.assert_close(y3[: y.shape[0]], y.detach())


def test_module_sbhd_matches_thd():
    torch.manual_seed(1)
    m = C.Compressor(32, 16, 4, rope_dim=8, dtype=torch.float32, rotate=True)
    x = torch.randn(18, 3, 32)
    y = m(x)
    assert y.shape == (4, 3, 16)
    for b in range(3):
        cu = torch.tensor([0, 18], dtype=torch.int32)
        yb, _ = m(x[:, b], cu)
        torch.testing.assert_close(y[:, b], yb)


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="coff"):
        C.Compressor(8, 8, 4, coff=3)
    with pytest.raises(ValueError, match="rotate=True needs a power of two"):
        C.Compressor(8, 12, 4, rotate=True, rope_dim=4)
    with pytest.raises(ValueError, match="pooling"):
        C.Compressor(8, 8, 4, pooling="magic", rope_dim=4)
    m = C.Compressor(8, 8, 4, pooling="fused", rope_dim=4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="pooling='fused'"):
        m(torch.randn(8, 8), torch.tensor([0, 8], dtype=torch.int32))


def test_rope_positions_continue_the_last_segment_on_padding_rows():
    from csa_compressor.module import rope_positions

    cuc = torch.tensor([0, 9, 9, 9, 24, 26], dtype=torch.int32)
    pos = rope_positions(cuc, 29, 4, max_seqlen=63)
    assert pos.tolist() == ([4 * i for i in range(9)] + [4 * i for i in range(15)]
                            + [0, 4] + [8, 12, 16])
    # Held to the last row of Megatron's max_seqlen // ratio table.
    assert rope_positions(torch.tensor([0, 2, 2, 2, 6]), 7, 128, max_seqlen=520).tolist() == \
        [0, 128, 0, 128, 256, 384, 384]


def test_yarn_keeps_the_fast_pairs_and_interpolates_the_slow_ones():
    from csa_compressor.module import YaRN, rope_inv_freq

    plain = rope_inv_freq(16, 10000.0)
    yarn = rope_inv_freq(16, 10000.0, YaRN(factor=4.0, original_max_position_embeddings=64))
    assert yarn[0] == plain[0] and torch.allclose(yarn[-1], plain[-1] / 4)
    assert ((yarn <= plain) & (yarn >= plain / 4)).all() and not torch.equal(yarn, plain)
    with pytest.raises(TypeError, match="rope_yarn"):
        C.Compressor(64, 32, 4, dtype=torch.float32, rope_yarn={"factor": 4})
