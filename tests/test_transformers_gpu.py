"""csa_compressor.transformers on the H200: a tiny DeepSeek-V4's training step (loss and
every gradient) and greedy generation (ids and every step's logits), installed against
not installed, numerics="eager"."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")
pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from csa_compressor import transformers as csa_hf  # noqa: E402
from hf_model import greedy, tiny_model, train_step  # noqa: E402

pytestmark = pytest.mark.gpu


def _ids(batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g).cuda()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("hca", [16, 128])
def test_training_step_is_bitwise_transformers(hf_clean, padded, hca):
    model = tiny_model(hca=hca, device="cuda", hidden=128, head_dim=128)
    ids = _ids(2, 2 * hca + 37)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, hca:] = 0
    want = train_step(model, ids, mask)
    csa_hf.install()
    got = train_step(model, ids, mask)
    assert not csa_hf.fallback_reasons(), csa_hf.fallback_reasons()
    assert torch.equal(want[0], got[0])
    for name, g in want[1].items():
        assert torch.equal(g, got[1][name]), name


@pytest.mark.parametrize("hca", [16, 128])
def test_greedy_generation_is_bitwise_transformers(hf_clean, hca):
    model = tiny_model(hca=hca, device="cuda", hidden=128, head_dim=128)
    ids = _ids(2, hca + 5)
    with torch.no_grad():
        want = greedy(model, ids, new=40)
        csa_hf.install()
        got = greedy(model, ids, new=40)
    assert not csa_hf.fallback_reasons(), csa_hf.fallback_reasons()
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
