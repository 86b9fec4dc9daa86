"""The grouped (context-parallel) layout against Megatron-LM's eager pre-grouped region,
written here as Megatron writes it (torch.roll of the previous groups, first blocks at
group id 0), with fp32 intermediates (CPU)."""

import pytest
import torch

from csa_compressor import grouped

CASES = [  # group ids: sequences of 3, 1 and 4 blocks, padding, a halo at row 0
    [0, 1, 2, 0, 0, 1, 2, 3],
    [0, 1, -1, -1, 0, 1],
    [5, 6, 7, 0, 1, 0],
    [0],
    [-1, 0, 1, -1],
]


def megatron_grouped_fp32(kv, score, ape, ids, ratio, coff):
    G, d = ids.numel(), kv.shape[1] // coff
    kv_g = kv.reshape(G, ratio, -1).float()
    sc_g = score.reshape(G, ratio, -1).float() + ape.view(1, ratio, -1)
    if coff == 2:
        is_first = ids == 0

        def overlap(t, fill):
            new = t.new_full((G, 2 * ratio, d), fill)
            new[:, ratio:] = t[:, :, d:]
            prev = torch.roll(t[:, :, :d], shifts=1, dims=0)
            prev[is_first] = fill
            new[:, :ratio] = prev
            return new

        kv_g, sc_g = overlap(kv_g, 0.0), overlap(sc_g, float("-inf"))
    w = torch.softmax(sc_g, dim=1, dtype=torch.float32)
    return (kv_g * w).sum(dim=1).to(kv.dtype)


@pytest.mark.parametrize("ids", CASES)
@pytest.mark.parametrize("ratio,coff", [(4, 2), (2, 2), (3, 1), (128, 1)])
def test_grouped_is_megatrons_pre_grouped_region(ids, ratio, coff):
    gen = torch.Generator().manual_seed(len(ids) * 10 + ratio)
    ids_t = torch.tensor(ids)
    G, d = len(ids), 6
    kv = torch.randn(G * ratio, coff * d, generator=gen, requires_grad=True)
    score = torch.randn(G * ratio, coff * d, generator=gen, requires_grad=True)
    ape = torch.randn(ratio, coff * d, generator=gen, requires_grad=True)
    got = grouped.compress_grouped_reference(kv, score, ape, ids_t, ratio=ratio, coff=coff)
    want = megatron_grouped_fp32(kv, score, ape, ids_t, ratio, coff)
    # Row 0 differs where it is a halo (ids[0] != 0, coff 2): there it is a first block.
    rows = torch.ones(G, dtype=torch.bool)
    if coff == 2 and ids[0] != 0:
        rows[0] = False
    assert got.shape == (G, d)
    assert torch.equal(got[rows], want[rows])
    # Gradients: padding groups and the halo row take none (downstream gives them none).
    g = torch.randn(G, d, generator=gen) * (ids_t >= 0)[:, None] * rows[:, None]
    a = torch.autograd.grad(got, (kv, score, ape), g)
    b = torch.autograd.grad(want, (kv, score, ape), g)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_padding_groups_take_no_gradient():
    ids = torch.tensor([0, 1, -1, 0])
    kv = torch.randn(16, 8, requires_grad=True)
    out = grouped.compress_grouped_reference(kv, torch.randn(16, 8), torch.randn(4, 8), ids,
                                             ratio=4, coff=2)
    g = torch.zeros(4, 4)
    g[2] = 1.0
    (dkv,) = torch.autograd.grad(out, kv, g)
    assert torch.equal(dkv, torch.zeros_like(dkv))


def test_offsets_are_the_thd_pack_of_the_groups():
    cu, cuc = grouped.grouped_offsets(torch.tensor([3, 4, 0, 1, 2, 0, -1]), 4)
    assert cu.tolist() == [0, 8, 20, 28, 28, 28, 28, 28]
    assert cuc.tolist() == [0, 2, 5, 7, 7, 7, 7, 7]


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(group_ids=torch.tensor([0.0, 1.0])), TypeError, "group_ids"),
    (dict(group_ids=torch.tensor([[0, 1]])), ValueError, "group_ids"),
    (dict(group_ids=torch.tensor([0, 1, 2])), ValueError, "kv: expected G\\*ratio"),
    (dict(ratio=0), ValueError, "ratio"),
])
def test_bad_grouped_input_names_the_argument(kwargs, error, name):
    args = dict(kv=torch.randn(8, 8), score=torch.randn(8, 8), ape=torch.randn(4, 8),
                group_ids=torch.tensor([0, 1]), ratio=4, coff=2)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        grouped.compress_grouped_reference(**args)


def test_kernel_level_grouped_entries_check_their_arguments():
    from csa_compressor.grouped import pool_backward_grouped, pool_forward_grouped

    kv, score, ape = torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="kv: expected G\\*ratio"):
        pool_forward_grouped(kv, score, ape, torch.tensor([0, 1, 2]), torch.empty(3, 4), ratio=4, coff=2)
    with pytest.raises(ValueError, match="grad_out"):
        pool_backward_grouped(kv, score, ape, torch.tensor([0, 1]), torch.empty(3, 4),
                              torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape),
                              ratio=4, coff=2)
    with pytest.raises(ValueError, match="CUDA"):  # the kernels need CUDA tensors
        pool_forward_grouped(kv, score, ape, torch.tensor([0, 1]), torch.empty(2, 4), ratio=4, coff=2)


@pytest.mark.parametrize("seed", range(20))
def test_any_group_ids_give_valid_offsets(seed):
    """Whatever the ids hold (huge, negative, repeated zeros, int64 extremes), the THD pack
    built from them is well formed: starts at 0, non-decreasing, ends at G*ratio tokens,
    its row offsets compressed_cu_seqlens of it. So malformed ids can only mislabel rows,
    never hand the kernels offsets outside the buffers."""
    from csa_compressor.grouped import grouped_offsets
    from csa_compressor.validation import check_offset_contents, validate

    gen = torch.Generator().manual_seed(seed)
    G, ratio = int(torch.randint(1, 40, (1,), generator=gen)), [1, 4, 128][seed % 3]
    pick = torch.randint(0, 4, (G,), generator=gen)
    ids = torch.where(pick == 0, torch.zeros(G, dtype=torch.int64),
                      torch.where(pick == 1, -torch.randint(1, 2**62, (G,), generator=gen),
                                  torch.randint(1, 2**62, (G,), generator=gen)))
    if seed % 2:
        ids = ids.to(torch.int32)
    cu, cuc = grouped_offsets(ids, ratio)
    assert int(cu[-1]) == G * ratio
    kv = torch.zeros(G * ratio, 2)
    p = validate(kv, kv, torch.zeros(ratio, 2), cu, cuc, G, ratio=ratio, coff=1)
    check_offset_contents(p)  # raises on any malformed offset
