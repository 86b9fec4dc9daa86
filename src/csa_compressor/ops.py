"""The torch-facing op, defined once for eager calls and torch.compile.

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

from .kernels.launch import launch_backward, launch_forward
from .validation import (Problem, check_pool_numerics, halves, kernel_aligned, validate,
                         validate_packed, validate_sbhd)


def _with(p: Problem, numerics: str) -> Problem:
    p.numerics = numerics
    return p


def _problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics="fp32"):
    """The op body's validation: SBHD where the offsets are None (``kv`` (S, B, coff*d))."""
    check_pool_numerics(numerics)
    if cu is None:
        return _with(validate_sbhd(kv, score, ape, ratio=ratio, coff=coff, for_kernel=True),
                     numerics)
    return _with(validate(kv, score, ape, cu, cuc, total_comp, ratio=ratio, coff=coff,
                          for_kernel=True), numerics)


def _rows(p: Problem, t):
    """What the kernels take of a caller-shaped tensor: SBHD sequence 0's view."""
    return t[:, 0] if p.batch else t


def _forward(p: Problem):
    shape = ((p.total_comp, p.batch, p.head_dim) if p.batch else (p.total_comp, p.head_dim))
    out = torch.empty(shape, dtype=p.kv.dtype, device=p.kv.device)
    launch_forward(p, _rows(p, out))
    return out


def _launch_backward(grad, p: Problem, grads):
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
    return dkv, dscore, _launch_backward(grad, p, (dkv, dscore))


@torch.library.custom_op("csa_compressor::pool_fwd", mutates_args=())
def pool_fwd_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                cu_seqlens: torch.Tensor | None, cu_seqlens_comp: torch.Tensor | None,
                total_comp: int, ratio: int, coff: int, numerics: str) -> torch.Tensor:
    return _forward(_problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
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
    return _backward(grad, _problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad.shape[0],
                                    ratio, coff, numerics))


@pool_bwd_op.register_fake
def _(grad, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, numerics):
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)


def _fwd(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics):
    if torch.compiler.is_compiling():
        return pool_fwd_op(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics)
    if cu is None:
        return _forward(_problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics))
    return _forward(Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim,
                            numerics=numerics))


def _bwd(grad, kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, numerics):
    if torch.compiler.is_compiling():
        return pool_bwd_op(grad, kv, score, ape, cu, cuc, ratio, coff, numerics)
    if cu is None:
        return _backward(grad, _problem(kv, score, ape, cu, cuc, total_comp, ratio, coff,
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
    return dkvs, _launch_backward(grad, p, halves(dkvs, p.score_first))


def _packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    check_pool_numerics(numerics)
    if cu is None:
        return _with(validate_sbhd(kvs, None, ape, ratio=ratio, coff=coff, for_kernel=True,
                                   packed=True, score_first=score_first), numerics)
    return _with(validate_packed(kvs, ape, cu, cuc, total_comp, ratio=ratio, coff=coff,
                                 for_kernel=True, score_first=score_first), numerics)


@torch.library.custom_op("csa_compressor::pool_fwd_packed", mutates_args=())
def pool_fwd_packed_op(kvs: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor | None,
                       cu_seqlens_comp: torch.Tensor | None, total_comp: int, ratio: int,
                       coff: int, score_first: bool, numerics: str) -> torch.Tensor:
    return _forward(_packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
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
    return _backward_packed(grad, _packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp,
                                                  grad.shape[0], ratio, coff, score_first,
                                                  numerics))


@pool_bwd_packed_op.register_fake
def _(grad, kvs, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, score_first, numerics):
    return torch.empty_like(kvs), torch.empty_like(ape)


def _packed_eager(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if cu is None:
        return _packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)
    return _packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)


def _fwd_packed(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if torch.compiler.is_compiling():
        return pool_fwd_packed_op(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first,
                                  numerics)
    return _forward(_packed_eager(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first,
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


def compress_thd_fused_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                              check_offsets: bool = False, score_first: bool = False,
                              numerics: str = "fp32", epilogue=None, norm_weight=None,
                              positions=None, rope_table=None):
    """compress_thd_fused with ``kv`` and ``score`` as the column halves of one tensor
    ``kvs`` ``(T, 2*coff*d)`` (``[kv | score]``, one projection's output; ``[score | kv]``
    where ``score_first``): ``(total_comp, head_dim)``, differentiable in ``kvs`` (one
    gradient of its layout) and ``ape``. Needs ``coff*d*element size`` a multiple of 16
    bytes. Results are bitwise those of compress_thd_fused on the two halves (``epilogue``
    and the rest: as compress_thd_fused's)."""
    check_pool_numerics(numerics)
    p = validate_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                        coff=coff, for_kernel=True, check_offsets=check_offsets,
                        score_first=score_first)
    return fused_from_problem(_with(p, numerics),
                              _finish(epilogue, norm_weight, positions, rope_table))


def compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                       deterministic=None, check_offsets: bool = False, numerics: str = "fp32",
                       epilogue=None, norm_weight=None, positions=None, rope_table=None):
    """Fused gated pooling over a packed THD batch: ``(total_comp, head_dim)``.

    Differentiable in ``kv``, ``score`` and ``ape``. Raises (never falls back) on anything
    the kernels do not support. ``cu_seqlens_comp=None`` derives it on the device.
    ``check_offsets=True`` (or CSA_COMPRESSOR_CHECK_OFFSETS=1) reads the offsets and raises
    on contents that break the layout (one host sync; skipped inside torch.compile and
    graph capture); by default they are not read, and bad contents give unspecified rows,
    never an out-of-bounds access. ``deterministic`` is accepted for API stability: the
    backward is always bitwise reproducible (dape partials are reduced in a fixed order),
    so both settings, and ``torch.use_deterministic_algorithms(True)``, give the same result.
    ``numerics="eager"`` rounds as Megatron-LM's eager region does (the softmax weights
    and each product in the input dtype; the backward's product gradients likewise)
    instead of the default fp32 region (docs/contract.md, "Eager numerics").

    ``epilogue`` (an Epilogue) with ``norm_weight`` ``(head_dim,)``: the rows go on
    through RMSNorm, the rotary embedding and the rotation, inside the pooling kernels
    where they take it (fused_epilogue), bitwise ``apply_epilogue`` of the pooled rows;
    differentiable in ``norm_weight`` too. ``positions`` ``(N,)``: the rows' rotary
    positions (default ``block_index * ratio``); ``rope_table``: apply_epilogue's.
    """
    check_pool_numerics(numerics)
    p = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio, coff=coff,
                 for_kernel=True, check_offsets=check_offsets)
    return fused_from_problem(_with(p, numerics),
                              _finish(epilogue, norm_weight, positions, rope_table))


def compress_sbhd_fused(kv, score, ape, *, ratio, coff, numerics: str = "fp32", epilogue=None,
                        norm_weight=None, positions=None, rope_table=None):
    """Fused gated pooling of ``B`` sequences of ``S`` tokens in the SBHD layout: ``kv`` and
    ``score`` ``(S, B, coff*d)`` -> ``(S // ratio, B, head_dim)`` (no rows where S < ratio).
    The kernels read the strided token rows in place (no transposed copy); results are
    bitwise those of compress_thd_fused on the sequences packed one after another.
    Differentiable in ``kv``, ``score`` and ``ape``; needs ``coff*d*element size`` and
    ``d*element size`` multiples of 16 bytes. ``numerics`` and ``epilogue``: as
    compress_thd_fused's (the positions default to ``row * ratio``, ``(n * B,)`` in the
    rows' ``(n, B)`` order)."""
    check_pool_numerics(numerics)
    return fused_from_problem(_with(validate_sbhd(kv, score, ape, ratio=ratio, coff=coff,
                                                  for_kernel=True), numerics),
                              _finish(epilogue, norm_weight, positions, rope_table))


def compress_sbhd_fused_packed(kvs, ape, *, ratio, coff, score_first: bool = False,
                               numerics: str = "fp32", epilogue=None, norm_weight=None,
                               positions=None, rope_table=None):
    """compress_sbhd_fused with ``kv`` and ``score`` as the column halves of one tensor
    ``kvs`` ``(S, B, 2*coff*d)`` (one projection's output; ``[score | kv]`` where
    ``score_first``), its gradient one tensor of that layout."""
    check_pool_numerics(numerics)
    return fused_from_problem(_with(validate_sbhd(kvs, None, ape, ratio=ratio, coff=coff,
                                                  for_kernel=True, packed=True,
                                                  score_first=score_first), numerics),
                              _finish(epilogue, norm_weight, positions, rope_table))


def _finish(epilogue, norm_weight, positions, rope_table):
    """The ops' epilogue arguments as a fused_epilogue.Finish (None: no epilogue)."""
    if epilogue is None:
        for name, v in (("norm_weight", norm_weight), ("positions", positions),
                        ("rope_table", rope_table)):
            if v is not None:
                raise ValueError(f"{name}: given without epilogue=")
        return None
    from .fused_epilogue import Finish

    return Finish(epilogue, norm_weight, positions, rope_table=rope_table)


def fused_from_problem(p: Problem, finish=None):
    """The fused op on arguments already validated for the kernels (validate,
    validate_packed or validate_sbhd: the dispatch and the module validate once and come
    here): the caller's tensors go through autograd where a gradient is wanted. With a
    ``finish`` (fused_epilogue.Finish), the epilogue's output."""
    if finish is not None:
        from .fused_epilogue import pool_with_epilogue

        return pool_with_epilogue(p, finish)
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
    return _forward(p)
