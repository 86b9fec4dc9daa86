"""The pooling as a torch-facing op, for eager calls and torch.compile.

Under torch.compile each direction is a ``torch.library`` custom op (opaque to the
compiler, a fake for its shapes) whose body validates and launches the kernels (_PoolFn,
_PackedFn). Eager calls bypass the custom-op dispatch (tens of microseconds of host time):
_EagerFn launches on the problem the caller already validated, and its backward on that
same problem, its tensors taken back from the saved ones, so the forward's offsets guard
(Problem.read_ape) serves both directions. Both paths launch the same kernels and give
bitwise identical results. The same ops take SBHD inputs ``(S, B, ...)`` where the offsets
are None: one segment of S tokens a sequence, the sequences one grid index of the kernels
(validation.validate_sbhd).
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


class _PoolFn(torch.autograd.Function):
    """The op's autograd path under torch.compile: each direction one custom op."""

    @staticmethod
    def forward(ctx, kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics):
        ctx.save_for_backward(kv, score, ape, cu, cuc)
        ctx.meta = (ratio, coff, numerics)
        return pool_fwd_op(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics)

    @staticmethod
    def backward(ctx, grad):
        dkv, dscore, dape = pool_bwd_op(grad, *ctx.saved_tensors, *ctx.meta)
        return dkv, dscore, dape, None, None, None, None, None, None


# The packed layout: kv and score as the column halves of one tensor kvs (T, 2*coff*d), as
# one projection GEMM writes them ([kv | score], or [score | kv] where score_first); the
# backward writes both gradients into one (T, 2*coff*d) tensor of the same layout, so the
# GEMM's backward takes it as it is (no copies, no add). SBHD where the offsets are None:
# kvs (S, B, 2*coff*d).

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


class _PackedFn(torch.autograd.Function):
    """The packed op's autograd path under torch.compile: each direction one custom op."""

    @staticmethod
    def forward(ctx, kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
        ctx.save_for_backward(kvs, ape, cu, cuc)
        ctx.meta = (ratio, coff, score_first, numerics)
        return pool_fwd_packed_op(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first,
                                  numerics)

    @staticmethod
    def backward(ctx, grad):
        dkvs, dape = pool_bwd_packed_op(grad, *ctx.saved_tensors, *ctx.meta)
        return dkvs, dape, None, None, None, None, None, None, None


def _empty(p: Problem) -> None:
    p.kv = p.score = p.ape = p.cu_seqlens = p.cu_seqlens_comp = p.kvs = p.read_ape = None
    p.full = None


class _EagerFn(torch.autograd.Function):
    """Eager calls' autograd path: the validated problem as it is, its tensors through
    save_for_backward (version checks, saved-tensor hooks). The node keeps the problem
    itself with its tensor fields emptied (the callers build one a call and hand it over)
    and fills them again from the saved tensors: rebuilding a Problem field by field cost
    ~4 µs of host time a step."""

    @staticmethod
    def forward(ctx, p, ape, *inputs):
        out = forward(p)
        ctx.save_for_backward(p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.kvs,
                              p.read_ape, *(p.full or ()))
        _empty(p)
        ctx.problem = p
        return out

    @staticmethod
    def backward(ctx, grad):
        p = ctx.problem
        (p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.kvs, p.read_ape,
         *full) = ctx.saved_tensors
        p.full = tuple(full) or None
        try:
            *grads, dape = _backward_packed(grad, p) if p.kvs is not None else _backward(grad, p)
        finally:  # the saved tensors stay the node's alone (retain_graph, hooks)
            _empty(p)
        return (None, dape, *grads)


def pool(p: Problem) -> torch.Tensor:
    """The fused pooling of a validated problem: the caller's tensors go through autograd
    where a gradient is wanted."""
    packed = p.kvs is not None
    inputs = (p.kvs,) if packed else (p.full or (p.kv, p.score))
    if torch.compiler.is_compiling():
        # SBHD: no offsets (the op body derives the one-segment pack again)
        cu, cuc = (None, None) if p.batch else (p.cu_seqlens, p.cu_seqlens_comp)
        if packed:
            return _PackedFn.apply(p.kvs, p.ape, cu, cuc, p.total_comp, p.ratio, p.coff,
                                   p.score_first, p.numerics)
        return _PoolFn.apply(*inputs, p.ape, cu, cuc, p.total_comp, p.ratio, p.coff,
                             p.numerics)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs + (p.ape,)):
        return _EagerFn.apply(p, p.ape, *inputs)
    # Nothing to differentiate: skip autograd.Function.apply (~10 µs of host time on the CPU
    # dev machine, a tenth of that for the check).
    return forward(p)
