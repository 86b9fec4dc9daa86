"""The eager autograd path of the pooling op on the CPU (launches replaced): the backward
runs on the forward's problem, so the offsets guard runs once a step and the kernels of
both directions read the same guarded APE; the packed layout's halves are the kernels'
untracked views while ``kvs`` itself is differentiated."""

import pytest
import torch

from csa_compressor import pooling, validation
from csa_compressor.kernels import launch
from packs import make_pack


def _fake_launches(monkeypatch):
    """Both directions' launches replaced by zero writes that record the APE each read
    (launch.ape_read), and the guard counted."""
    seen = {"guard": 0, "fwd": [], "bwd": []}

    def guard(cu, cuc, ape, T, N, ratio, shape):
        seen["guard"] += 1
        return ape.clone()

    def fwd(p, out, *a, **k):
        seen["fwd"].append(launch.ape_read(p))
        return out.zero_()

    def bwd(p, grad_out, grad_kv, grad_score, grad_ape, *a, **k):
        seen["bwd"].append(launch.ape_read(p))
        for g in (grad_kv, grad_score, grad_ape):
            g.zero_()

    monkeypatch.setattr(launch, "guarded_ape", guard)
    monkeypatch.setattr(pooling, "launch_forward", fwd)
    monkeypatch.setattr(pooling, "launch_backward", bwd)
    return seen


@pytest.mark.parametrize("packed", [False, True])
def test_one_offsets_guard_a_step(monkeypatch, packed):
    kv, score, ape, cu, cuc, N = make_pack([9, 13, 4], 8, 4, 2)
    seen = _fake_launches(monkeypatch)
    a = ape.clone().requires_grad_(True)
    if packed:
        kvs = torch.cat((kv, score), 1).requires_grad_(True)
        p = validation.validate_packed(kvs, a, cu, cuc, N, ratio=4, coff=2, contents=False)
        leaves = (kvs, a)
    else:
        kv, score = kv.requires_grad_(True), score.requires_grad_(True)
        p = validation.validate(kv, score, a, cu, cuc, N, ratio=4, coff=2, contents=False)
        leaves = (kv, score, a)
    out = pooling.pool(p)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert seen["guard"] == 1, seen["guard"]  # the backward took the forward's guarded APE
    assert len(seen["fwd"]) == len(seen["bwd"]) == 1
    assert seen["bwd"][0] is seen["fwd"][0]
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    # a second step guards again: the guarded APE belongs to one call's problem
    out = pooling.pool(validation.validate(kv.detach(), score.detach(), a, cu, cuc, N, ratio=4,
                                           coff=2, contents=False))
    torch.autograd.grad(out, a, torch.ones_like(out))
    assert seen["guard"] == 2


def test_the_packed_halves_are_untracked_views(monkeypatch):
    kv, score, ape, cu, cuc, N = make_pack([9, 13], 8, 4, 2)
    kvs = torch.cat((kv, score), 1).requires_grad_(True)
    for p in (validation.validate_packed(kvs, ape, cu, cuc, N, ratio=4, coff=2),
              validation.validate_sbhd(kvs.view(11, 2, -1), None, ape, ratio=4, coff=2,
                                       packed=True)):
        assert not p.kv.requires_grad and not p.score.requires_grad
        assert p.kv.data_ptr() == kvs.data_ptr()  # views, not copies
        assert p.kvs is kvs or p.kvs.requires_grad
    seen = _fake_launches(monkeypatch)
    p = validation.validate_packed(kvs, ape, cu, cuc, N, ratio=4, coff=2, contents=False)
    out = pooling.pool(p)
    assert out.requires_grad  # the op differentiates kvs itself
    (g,) = torch.autograd.grad(out, kvs, torch.ones_like(out))
    assert g.shape == kvs.shape and len(seen["bwd"]) == 1


@pytest.fixture
def launches(monkeypatch):
    """Every launch on the CPU recorded in place of the kernels (compile.stand_in and
    jit.stand_in_small, the package's seams), validation past its CUDA-only checks."""
    from contextlib import ExitStack

    from csa_compressor import ops
    from csa_compressor.kernels import compile as cc, jit, plan

    def any_device(fn):
        return lambda *a, for_kernel=False, **k: fn(*a, **k)

    for name in ("validate", "validate_packed", "validate_sbhd"):
        monkeypatch.setattr(ops, name, any_device(getattr(validation, name)))
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    seen, cpu = [], torch.device("cpu")

    def record(*args):
        seen.append(args)

    with ExitStack() as stack:
        stack.enter_context(jit.stand_in_small(("offsets_guard", 4), cpu, record))
        for direction in ("fwd", "bwd"):
            for rs, batch in ((0, 0), (32, 0), (2 * 16, 2), (2 * 32, 2)):
                stack.enter_context(cc.stand_in(plan.spec(direction, torch.float32, 4, 2, 8,
                                                          row_stride=rs, batch=batch), cpu, record))
        yield seen


@pytest.mark.parametrize("layout", ["thd", "packed", "sbhd", "packed_epilogue"])
def test_launches_a_training_step(launches, layout):
    """A forward + autograd.grad launches the pooling forward, its backward and the dape
    sum, and for a THD pack one offsets guard for both directions: 4 (THD) or 3 (SBHD).
    With the epilogue (by parts here: its own kernels are torch ops on the CPU) the
    pooling's launches are the same."""
    from csa_compressor import Epilogue, ops

    kv, score, ape, cu, cuc, N = make_pack([12, 8], 8, 4, 2)
    a = ape.requires_grad_(True)
    if layout.startswith("packed"):
        leaves = (torch.cat((kv, score), 1).requires_grad_(True), a)
        ep = {}
        if layout == "packed_epilogue":
            w = torch.ones(8, requires_grad=True)
            ep = dict(epilogue=Epilogue(rope_dim=4), norm_weight=w)
            leaves += (w,)
        out = ops.compress_thd_fused_packed(leaves[0], a, cu, cuc, N, ratio=4, coff=2, **ep)
    elif layout == "thd":
        leaves = (kv.requires_grad_(True), score.requires_grad_(True), a)
        out = ops.compress_thd_fused(*leaves, cu, cuc, N, ratio=4, coff=2)
    else:
        leaves = (kv.view(10, 2, 16).requires_grad_(True), score.view(10, 2, 16).requires_grad_(True), a)
        out = ops.compress_sbhd_fused(*leaves, ratio=4, coff=2)
    assert len(launches) == (1 if layout == "sbhd" else 2)
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert len(launches) == (3 if layout == "sbhd" else 4), [len(x) for x in launches]


def test_the_saved_problem_keeps_autograd_checks_and_hooks(monkeypatch):
    """The eager path saves the problem's tensors through save_for_backward: an in-place
    change of kvs between forward and backward raises (as for any saved input), and
    saved-tensor hooks (activation offloading) see every tensor the backward reads."""
    kv, score, ape, cu, cuc, N = make_pack([9, 13], 8, 4, 2)
    _fake_launches(monkeypatch)
    kvs = torch.cat((kv, score), 1).requires_grad_(True)
    leaf = kvs * 1  # a non-leaf, so the in-place change below is allowed
    out = pooling.pool(validation.validate_packed(leaf, ape, cu, cuc, N, ratio=4, coff=2,
                                                  contents=False))
    leaf.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, kvs, torch.ones_like(out))
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pooling.pool(validation.validate_packed(kvs, ape, cu, cuc, N, ratio=4, coff=2,
                                                      contents=False))
    assert any(t.data_ptr() == kvs.data_ptr() and t.shape == kvs.shape for t in packed)
    assert any(t is not None and t.shape == cu.shape for t in packed)
    torch.autograd.grad(out, kvs, torch.ones_like(out))


def test_a_grouped_step_launches_no_offsets_guard(launches, monkeypatch):
    """compress_grouped's offsets are built well formed (grouped.grouped_offsets), so its
    training step launches the pooling forward, backward and dape sum alone: the device
    offsets guard that the THD op runs on a caller's offsets is skipped."""
    from csa_compressor import grouped

    monkeypatch.setattr(grouped, "validate",
                        lambda *a, for_kernel=False, **k: validation.validate(*a, **k))
    ids = torch.tensor([0, 1, -1, 0, 1, 2, 5])
    G = ids.numel()
    leaves = [torch.randn(G * 4, 16, requires_grad=True) for _ in range(2)]
    leaves.append(torch.randn(4, 16, requires_grad=True))
    out = grouped.compress_grouped(*leaves, ids, ratio=4, coff=2)
    assert out.shape == (G, 8) and len(launches) == 1, [len(x) for x in launches]
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert len(launches) == 3, [len(x) for x in launches]
