"""csa_compressor.streaming on the fused kernels (H200): every emitted row bitwise the
fused training op's, eager and in a captured decode graph."""

import pytest
import torch

from csa_compressor import Epilogue, streaming
from stream_driver import Stream, training_rows

pytestmark = pytest.mark.gpu

CONFIGS = [(4, 2), (128, 1), (1, 1), (2, 1), (8, 1)]


def _lens(ratio, k, seed):
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(ratio, 4 * ratio + 40, (k,), generator=g)]


@pytest.mark.parametrize("ratio,coff", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("epilogue", [None, Epilogue(rope_dim=64)])
def test_fused_generation_rows_are_the_fused_training_rows(ratio, coff, dtype, head_dim, epilogue):
    st = streaming.StreamState(4, head_dim, ratio=ratio, coff=coff, dtype=dtype, device="cuda")
    run = Stream(st, _lens(ratio, 6, head_dim + ratio), seed=ratio, ep=epilogue, pooling="fused",
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


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_captured_decode_replays_64_steps(ratio, coff):
    B, d, dev, steps = 8, 512, "cuda", 64
    ep = Epilogue(rope_dim=64)
    g = torch.Generator(device=dev).manual_seed(0)
    prompts = [int(x) for x in torch.randint(1, 3 * ratio, (B,))]
    lens = [p + steps for p in prompts]
    T, W = sum(lens), coff * d
    kv = torch.randn(T, W, device=dev, generator=g).bfloat16()
    sc = torch.randn(T, W, device=dev, generator=g).bfloat16()
    ape = torch.randn(ratio, W, device=dev, generator=g)
    w = torch.rand(d, device=dev, generator=g) + 0.5
    start = [0] + torch.tensor(lens).cumsum(0).tolist()
    st = streaming.StreamState(B, d, ratio=ratio, coff=coff, device=dev)
    kw = dict(epilogue=ep, norm_weight=w, pooling="fused")
    got = [dict() for _ in range(B)]
    pre = torch.cat([kv[start[b]:start[b] + prompts[b]] for b in range(B)])
    pre_s = torch.cat([sc[start[b]:start[b] + prompts[b]] for b in range(B)])
    cu = [0] + torch.tensor(prompts).cumsum(0).tolist()
    res = streaming.prefill(st, pre, pre_s, ape, cu, list(range(B)), **kw)
    for row, s, p in zip(res.rows, res.slots.tolist(), res.positions.tolist()):
        got[s][p // ratio] = row.clone()
    kv_buf = torch.empty(B, 1, W, device=dev, dtype=torch.bfloat16)
    sc_buf = torch.empty_like(kv_buf)
    slots = torch.arange(B, device=dev)

    def feed(k):
        idx = torch.tensor([start[b] + prompts[b] + k for b in range(B)], device=dev)
        kv_buf.copy_(kv[idx].view(B, 1, W))
        sc_buf.copy_(sc[idx].view(B, 1, W))

    def keep(step):
        for b in range(B):
            if bool(step.emitted[b, 0]):
                got[b][int(step.positions[b, 0]) // ratio] = step.rows[b, 0].clone()

    feed(0)
    keep(streaming.decode(st, kv_buf, sc_buf, ape, slots, **kw))  # compiles, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streaming.decode(st, kv_buf, sc_buf, ape, slots, **kw)
    for k in range(1, steps):
        feed(k)
        graph.replay()
        keep(out)
    want = training_rows(kv, sc, ape, lens, ratio, coff, "fp32", ep, w, fused=True)
    for b in range(B):
        assert sorted(got[b]) == list(range(want[b].shape[0]))
        for i in range(want[b].shape[0]):
            assert torch.equal(got[b][i], want[b][i]), (b, i)
    assert int(st.count[:B].min()) == min(lens)


def test_captured_decode_poisons_a_bad_slot():
    dev = "cuda"
    st = streaming.StreamState(4, 128, ratio=4, coff=2, device=dev)
    kv = torch.randn(4, 1, 256, device=dev).bfloat16()
    ape = torch.randn(4, 256, device=dev)
    slots = torch.arange(4, device=dev)
    streaming.decode(st, kv, kv, ape, slots, pooling="fused")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streaming.decode(st, kv, kv, ape, slots, pooling="fused")
    slots.copy_(torch.tensor([0, 1, 9, 1], device=dev))  # 9: out of range; 1 twice
    for _ in range(4):
        graph.replay()
    rows = out.rows.float()
    assert rows[2].isnan().all() and rows[1].isnan().all() and rows[3].isnan().all()
    assert not rows[0].isnan().any()
    assert st.bad[:4].tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="reset it"):
        streaming.decode(st, kv, kv, ape, torch.tensor([1, 0, 2, 3]), pooling="fused")
