"""csa_compressor.transformers on the CPU: install() keeps transformers' own compressor and
says why; with the fused pooling standing in on the CPU (the reference in the kernels'
place), training (loss and every gradient) and greedy generation (ids and every step's
logits) are bitwise transformers' own."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")
pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from csa_compressor import transformers as csa_hf  # noqa: E402
from hf_model import greedy, tiny_model, train_step  # noqa: E402


def _ids(batch=2, seq=70, seed=1):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_on_the_cpu_install_keeps_transformers_code_and_says_why(hf_clean):
    model = tiny_model()
    ids = _ids()
    want = model(input_ids=ids).logits
    with csa_hf.installed():
        got = model(input_ids=ids).logits
    assert torch.equal(want, got)
    reasons = csa_hf.fallback_reasons()
    assert reasons and all("CUDA" in r or "cuda" in r for r in reasons), reasons


@pytest.mark.parametrize("padded", [False, True])
def test_training_step_is_bitwise_transformers(hf_clean, fused_on_cpu, padded):
    model = tiny_model()
    ids = _ids(seq=69)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 50:] = 0
    want = train_step(model, ids, mask)
    csa_hf.install()
    got = train_step(model, ids, mask)
    assert fused_on_cpu, "the fused pooling was not called"
    assert not csa_hf.fallback_reasons(), csa_hf.fallback_reasons()
    assert torch.equal(want[0], got[0])
    assert want[1].keys() == got[1].keys()
    for name, g in want[1].items():
        assert torch.equal(g, got[1][name]), name


def test_greedy_generation_is_bitwise_transformers(hf_clean, fused_on_cpu, monkeypatch):
    from csa_compressor import streaming

    steps = []
    decode = streaming.decode
    monkeypatch.setattr(streaming, "decode", lambda st, kv, *a, **k: steps.append(
        kv.shape[1]) or decode(st, kv, *a, **k))
    model = tiny_model(hca=16)
    ids = _ids(seq=23)
    with torch.no_grad():
        want = greedy(model, ids, new=40)
        csa_hf.install()
        got = greedy(model, ids, new=40)
    assert fused_on_cpu and not csa_hf.fallback_reasons(), csa_hf.fallback_reasons()
    # each generated token is a one-token decode step of every compressor's stream
    assert steps and set(steps) == {1}, steps
    assert torch.equal(want[0], got[0])
    assert torch.equal(want[1], got[1])


def test_reorder_and_reset_carry_the_streams(hf_clean, fused_on_cpu):
    from transformers import DynamicCache

    model = tiny_model(hca=8)
    ids = _ids(seq=13)
    beam = torch.tensor([1, 1])

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.reorder_cache(beam)
            steps = [model(input_ids=ids[:, k:k + 1] * 0 + k, past_key_values=cache,
                           use_cache=True).logits for k in range(9)]
            cache.reset()
            again = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return torch.stack(steps), again

    want = run()
    csa_hf.install()
    got = run()
    assert not csa_hf.fallback_reasons(), csa_hf.fallback_reasons()
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_unknown_modules_and_cache_layers_are_named():
    from csa_compressor.transformers import pooling

    class Layer:  # a cache layer without the compressor's bookkeeping (e.g. a static one)
        pass

    assert "has no entry_count, update_compressor_states" in pooling.cache_reason(Layer())
    why = pooling.reason(torch.nn.Linear(2, 2), torch.zeros(1, 4, 2))
    assert why.startswith("Linear has no kv_proj, gate_proj, position_bias"), why


def test_fp32_numerics_pool_in_fp32(hf_clean, fused_on_cpu):
    """numerics="fp32": the pooling's weights and products stay fp32 (one rounding), so
    the logits move off transformers' own, stay finite, and train."""
    model = tiny_model()
    ids = _ids(seq=40)
    want = model(input_ids=ids).logits
    with csa_hf.installed(numerics="fp32"):
        got = model(input_ids=ids).logits
        loss, grads = train_step(model, ids)
    assert not csa_hf.fallback_reasons() and fused_on_cpu
    assert torch.isfinite(got).all() and not torch.equal(want, got)
    assert torch.isfinite(loss) and grads
    with pytest.raises(ValueError, match="numerics"):
        csa_hf.install(numerics="bf16")


def test_a_cache_whose_first_call_fell_back_stays_with_transformers(hf_clean, fused_on_cpu, monkeypatch):
    """The kernels refusing a cache's first call (here: every call of the HCA layer) leaves
    that compressor on transformers' own buffers for the whole generation: the same tokens
    and logits, and the reason recorded."""
    from csa_compressor.transformers import pooling

    real = pooling.stateless

    def refuse_hca(kv, gate, bias, ratio, coff):
        return (None, "refused for the test") if ratio == 16 else real(kv, gate, bias, ratio, coff)

    model = tiny_model(hca=16)
    ids = _ids(seq=23)
    with torch.no_grad():
        want = greedy(model, ids, new=30)
        csa_hf.install()
        monkeypatch.setattr(pooling, "stateless", refuse_hca)
        got = greedy(model, ids, new=30)
    assert "refused for the test" in csa_hf.fallback_reasons()
    assert any("transformers' own compressor state" in r for r in csa_hf.fallback_reasons())
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
