"""csa_compressor.streaming on the fused kernels (H200): every emitted row bitwise the
fused training op's, eager and in a captured decode graph."""

import pytest
import torch

from csa_compressor import Epilogue, streaming
from stream_driver import Stream, captured_replay, random_lens, takes_the_ring_kernel

pytestmark = pytest.mark.gpu

CONFIGS = [(4, 2), (128, 1), (1, 1), (2, 1), (8, 1)]


def _lens(ratio, k, seed):
    return random_lens(ratio, k, seed, 4 * ratio + 40)


@pytest.mark.parametrize("ratio,coff", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("epilogue", [None, Epilogue(rope_dim=64)])
@pytest.mark.parametrize("pooling", ["fused", "ring"])
def test_fused_generation_rows_are_the_fused_training_rows(ratio, coff, dtype, head_dim, epilogue,
                                                           pooling):
    """Both decode paths; "ring" takes its kernel wherever the window fits it, and at ratio
    128 pools each closing window where it lies in its ring (steps._in_place)."""
    st = streaming.StreamState(4, head_dim, ratio=ratio, coff=coff, dtype=dtype, device="cuda")
    assert st.aligned == (ratio == 128)
    if pooling == "ring":
        assert takes_the_ring_kernel(st) == (ratio * coff <= 16)
    run = Stream(st, _lens(ratio, 6, head_dim + ratio), seed=ratio, ep=epilogue, pooling=pooling,
                 max_n=4, slot_tensor_on_device=head_dim == 128)
    run.run()
    run.check(fused=True)


@pytest.mark.parametrize("numerics", ["fp32", "eager"])
def test_fused_eager_numerics(numerics):
    st = streaming.StreamState(3, 512, ratio=4, coff=2, device="cuda")
    run = Stream(st, _lens(4, 5, 1), seed=1, numerics=numerics, ep=Epilogue(), pooling="fused",
                 max_n=2)
    run.run()
    run.check(fused=True)


@pytest.mark.parametrize("ratio,coff,pooling", [(4, 2, "fused"), (128, 1, "fused"),
                                                (128, 1, "ring")])
def test_captured_decode_replays_64_steps(ratio, coff, pooling):
    captured_replay(ratio, coff, torch.bfloat16, Epilogue(rope_dim=64), pooling)


@pytest.mark.parametrize("max_n", [1, 3])
@pytest.mark.parametrize("epilogue", [None, Epilogue(rope_dim=64)])
def test_aligned_rings_of_one_or_two_windows(max_n, epilogue):
    """Ratio 128's rings hold one window (max_next_n 1) or two; decode pools in place,
    prefill's boundary rows read the ring: every row the fused training op's."""
    st = streaming.StreamState(5, 128, ratio=128, coff=1, device="cuda", max_next_n=max_n)
    assert st.aligned and st.history == (128 if max_n == 1 else 256)
    run = Stream(st, _lens(128, 7, max_n), seed=max_n, ep=epilogue, pooling="ring", max_n=max_n)
    run.run()
    run.check(fused=True)
