"""The pooling as a torch-facing op, defined once for eager calls and torch.compile.

Each direction is a ``torch.library`` custom op (opaque to the compiler, a fake for its
shapes) whose body validates and launches the kernels. ``_fwd`` / ``_bwd`` are the eager
bypass: outside torch.compile they run the body's launch on the problem the caller already
validated (a custom-op dispatch costs tens of microseconds of host time), under
torch.compile they call the op. One ``autograd.Function`` calls them in both modes, so
eager and compiled runs share the autograd path and the launches, and give bitwise
identical results; inputs are validated once per call either way (by the caller in eager
mode, by the op's body when compiled). The same ops take SBHD inputs ``(S, B, ...)`` where
the offsets are None: one segment of S tokens a sequence, the sequences one grid index of
the kernels (validation.validate_sbhd).
"""

from __future__ import annotations

import torch

from .checks import check_pool_numerics, halves, kernel_aligned
from .kernels.launch import launch_backward, launch_forward
from .validation import Problem, validate, validate_packed, validate_sbhd


def with_numerics(p: Problem, numerics: str) -> Problem:
    p.numerics = numerics
    return p


def problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics="fp32"):
    """The op body's validation: SBHD where the offsets are None (``kv`` (S, B, coff*d))."""
    check_pool_numerics(numerics)
    if cu is None:
        return with_numerics(validate_sbhd(kv, score, ape, ratio=ratio, coff=coff, for_kernel=True),
                     numerics)
    return with_numerics(validate(kv, score, ape, cu, cuc, total_comp, ratio=ratio, coff=coff,
                          for_kernel=True), numerics)


def _rows(p: Problem, t):
    """What the kernels take of a caller-shaped tensor: SBHD sequence 0's view."""
    return t[:, 0] if p.batch else t


def forward(p: Problem):
    shape = ((p.total_comp, p.batch, p.head_dim) if p.batch else (p.total_comp, p.head_dim))
    out = torch.empty(shape, dtype=p.kv.dtype, device=p.kv.device)
    launch_forward(p, _rows(p, out))
    return out


def launch_backward_into(grad, p: Problem, grads):
    """The backward into fresh ``grads`` (caller-shaped dkv and dscore, or the packed
    tensor's two halves) and a fresh dape: no need to check them."""
    dape = torch.empty_like(p.ape)
    if p.batch and (p.total_comp == 0 or p.num_tokens == 0):
        for g in grads:  # no rows: the launch would zero sequence 0's views only
            g.zero_()
        return dape.zero_()
    launch_backward(p, _rows(p, kernel_aligned(grad)), *(_rows(p, g) for g in grads), dape)
    return dape


def _backward(grad, p: Problem):
    dkv, dscore = (torch.empty_like(t) for t in (p.full or (p.kv, p.score)))
    return dkv, dscore, launch_backward_into(grad, p, (dkv, dscore))


@torch.library.custom_op("csa_compressor::pool_fwd", mutates_args=())
def pool_fwd_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                cu_seqlens: torch.Tensor | None, cu_seqlens_comp: torch.Tensor | None,
                total_comp: int, ratio: int, coff: int, numerics: str) -> torch.Tensor:
    return forward(problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                             numerics))


@pool_fwd_op.register_fake
def _(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, numerics):
    if cu_seqlens is None:
        return kv.new_empty((total_comp, kv.shape[1], kv.shape[2] // coff))
    return kv.new_empty((total_comp, kv.shape[-1] // coff))


@torch.library.custom_op("csa_compressor::pool_bwd", mutates_args=())
def pool_bwd_op(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                cu_seqlens: torch.Tensor | None, cu_seqlens_comp: torch.Tensor | None, ratio: int,
                coff: int, numerics: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad.shape[0],
                                    ratio, coff, numerics))


@pool_bwd_op.register_fake
def _(grad, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, numerics):
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)


def _fwd(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics):
    if torch.compiler.is_compiling():
        return pool_fwd_op(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics)
    if cu is None:
        return forward(problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics))
    return forward(Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim,
                            numerics=numerics))


def _bwd(grad, kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics):
    if torch.compiler.is_compiling():
        return pool_bwd_op(grad, kv, score, ape, cu, cuc, ratio, coff, numerics)
    if cu is None:
        return _backward(grad, problem(kv, score, ape, cu, cuc, total_comp, ratio, coff,
                                        numerics))
    return _backward(grad, Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim,
                                   numerics=numerics))


class _PoolFn(torch.autograd.Function):
    """The op's one autograd path (eager and compiled)."""

    @staticmethod
    def forward(ctx, kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics):
        ctx.save_for_backward(kv, score, ape, cu, cuc)
        ctx.meta = (total_comp, ratio, coff, head_dim, numerics)
        return _fwd(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics)

    @staticmethod
    def backward(ctx, grad):
        dkv, dscore, dape = _bwd(grad, *ctx.saved_tensors, *ctx.meta)
        return dkv, dscore, dape, None, None, None, None, None, None, None


# The packed layout: kv and score as the column halves of one tensor kvs (T, 2*coff*d), as
# one projection GEMM writes them ([kv | score], or [score | kv] where score_first); the
# backward writes both gradients into one (T, 2*coff*d) tensor of the same layout, so the
# GEMM's backward takes it as it is (no copies, no add). SBHD where the offsets are None:
# kvs (S, B, 2*coff*d).

def _packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    """The Problem of arguments already validated by validate_packed (kvs 2-D)."""
    w = kvs.shape[1] // 2
    return Problem(*halves(kvs, score_first), ape, cu, cuc, total_comp, ratio, coff, w // coff,
                   kvs.shape[1], kvs, score_first=score_first, numerics=numerics)


def _backward_packed(grad, p: Problem):
    dkvs = torch.empty_like(p.kvs)
    return dkvs, launch_backward_into(grad, p, halves(dkvs, p.score_first))


def packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    check_pool_numerics(numerics)
    if cu is None:
        return with_numerics(validate_sbhd(kvs, None, ape, ratio=ratio, coff=coff, for_kernel=True,
                                   packed=True, score_first=score_first), numerics)
    return with_numerics(validate_packed(kvs, ape, cu, cuc, total_comp, ratio=ratio, coff=coff,
                                 for_kernel=True, score_first=score_first), numerics)


@torch.library.custom_op("csa_compressor::pool_fwd_packed", mutates_args=())
def pool_fwd_packed_op(kvs: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor | None,
                       cu_seqlens_comp: torch.Tensor | None, total_comp: int, ratio: int,
                       coff: int, score_first: bool, numerics: str) -> torch.Tensor:
    return forward(packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                                    score_first, numerics))


@pool_fwd_packed_op.register_fake
def _(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, score_first, numerics):
    if cu_seqlens is None:
        return kvs.new_empty((total_comp, kvs.shape[1], kvs.shape[2] // (2 * coff)))
    return kvs.new_empty((total_comp, kvs.shape[-1] // (2 * coff)))


@torch.library.custom_op("csa_compressor::pool_bwd_packed", mutates_args=())
def pool_bwd_packed_op(grad: torch.Tensor, kvs: torch.Tensor, ape: torch.Tensor,
                       cu_seqlens: torch.Tensor | None, cu_seqlens_comp: torch.Tensor | None,
                       ratio: int, coff: int, score_first: bool, numerics: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_packed(grad, packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp,
                                                  grad.shape[0], ratio, coff, score_first,
                                                  numerics))


@pool_bwd_packed_op.register_fake
def _(grad, kvs, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, score_first, numerics):
    return torch.empty_like(kvs), torch.empty_like(ape)


def _packed_eager(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if cu is None:
        return packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)
    return _packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)


def _fwd_packed(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if torch.compiler.is_compiling():
        return pool_fwd_packed_op(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first,
                                  numerics)
    return forward(_packed_eager(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first,
                                  numerics))


def _bwd_packed(grad, kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if torch.compiler.is_compiling():
        return pool_bwd_packed_op(grad, kvs, ape, cu, cuc, ratio, coff, score_first, numerics)
    return _backward_packed(grad, _packed_eager(kvs, ape, cu, cuc, total_comp, ratio, coff,
                                                score_first, numerics))


class _PackedFn(torch.autograd.Function):
    """The packed op's one autograd path (eager and compiled)."""

    @staticmethod
    def forward(ctx, kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
        ctx.save_for_backward(kvs, ape, cu, cuc)
        ctx.meta = (total_comp, ratio, coff, score_first, numerics)
        return _fwd_packed(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)

    @staticmethod
    def backward(ctx, grad):
        dkvs, dape = _bwd_packed(grad, *ctx.saved_tensors, *ctx.meta)
        return dkvs, dape, None, None, None, None, None, None, None


def pool(p: Problem) -> torch.Tensor:
    """The fused pooling of a validated problem: the caller's tensors go through autograd
    where a gradient is wanted."""
    packed = p.kvs is not None
    inputs = (p.kvs,) if packed else (p.full or (p.kv, p.score))
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            t.requires_grad for t in inputs + (p.ape,))):
        # SBHD: no offsets (the op body derives the one-segment pack again)
        cu, cuc = (None, None) if p.batch else (p.cu_seqlens, p.cu_seqlens_comp)
        if packed:
            return _PackedFn.apply(p.kvs, p.ape, cu, cuc, p.total_comp, p.ratio, p.coff,
                                   p.score_first, p.numerics)
        return _PoolFn.apply(*inputs, p.ape, cu, cuc, p.total_comp, p.ratio, p.coff, p.head_dim,
                             p.numerics)
    # Nothing to differentiate: skip autograd.Function.apply (~10 µs of host time on the CPU
    # dev machine, a tenth of that for the check).
    return forward(p)
