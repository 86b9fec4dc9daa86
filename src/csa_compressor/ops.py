"""The torch-facing op, defined once for eager calls and torch.compile.

Each direction is a ``torch.library`` custom op (opaque to the compiler, a fake for its
shapes) whose body validates and launches the kernels. ``_fwd`` / ``_bwd`` are the eager
bypass: outside torch.compile they run the body's launch on the problem the caller already
validated (a custom-op dispatch costs tens of microseconds of host time), under
torch.compile they call the op. One ``autograd.Function`` calls them in both modes, so
eager and compiled runs share the autograd path and the launches, and give bitwise
identical results; inputs are validated once per call either way (by the caller in eager
mode, by the op's body when compiled).
"""

from __future__ import annotations

import torch

from .kernels.launch import launch_backward, launch_forward
from .validation import Problem, validate, validate_packed


def _problem(kv, score, ape, cu, cuc, total_comp, ratio, coff):
    return validate(kv, score, ape, cu, cuc, total_comp, ratio=ratio, coff=coff, for_kernel=True)


def _forward(p: Problem):
    out = torch.empty((p.total_comp, p.head_dim), dtype=p.kv.dtype, device=p.kv.device)
    return launch_forward(p, out)


def _backward(grad, p: Problem):
    # The output buffers are fresh allocations of the right shape: no need to check them.
    grad = grad.contiguous()
    if grad.data_ptr() % 16:
        grad = grad.clone()
    dkv = torch.empty_like(p.kv)
    dscore = torch.empty_like(p.score)
    dape = torch.empty_like(p.ape)
    return launch_backward(p, grad, dkv, dscore, dape)


@torch.library.custom_op("csa_compressor::pool_fwd", mutates_args=())
def pool_fwd_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor,
                cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int, coff: int) -> torch.Tensor:
    return _forward(_problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff))


@pool_fwd_op.register_fake
def _(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff):
    return kv.new_empty((total_comp, kv.shape[1] // coff))


@torch.library.custom_op("csa_compressor::pool_bwd", mutates_args=())
def pool_bwd_op(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, ratio: int,
                coff: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad, _problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad.shape[0], ratio, coff))


@pool_bwd_op.register_fake
def _(grad, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)


def _fwd(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim):
    if torch.compiler.is_compiling():
        return pool_fwd_op(kv, score, ape, cu, cuc, total_comp, ratio, coff)
    return _forward(Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim))


def _bwd(grad, kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim):
    if torch.compiler.is_compiling():
        return pool_bwd_op(grad, kv, score, ape, cu, cuc, ratio, coff)
    return _backward(grad, Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim))


class _PoolFn(torch.autograd.Function):
    """The op's one autograd path (eager and compiled)."""

    @staticmethod
    def forward(ctx, kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim):
        ctx.save_for_backward(kv, score, ape, cu, cuc)
        ctx.meta = (total_comp, ratio, coff, head_dim)
        return _fwd(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim)

    @staticmethod
    def backward(ctx, grad):
        dkv, dscore, dape = _bwd(grad, *ctx.saved_tensors, *ctx.meta)
        return dkv, dscore, dape, None, None, None, None, None, None


# The packed layout: kv and score as the column halves of one tensor kvs (T, 2*coff*d), as
# one projection GEMM writes them; the backward writes both gradients into one (T, 2*coff*d)
# tensor of the same layout, so the GEMM's backward takes it as it is (no copies, no add).

def _packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff):
    """The Problem of arguments already validated by validate_packed (kvs 2-D)."""
    w = kvs.shape[1] // 2
    return Problem(kvs[:, :w], kvs[:, w:], ape, cu, cuc, total_comp, ratio, coff, w // coff,
                   kvs.shape[1], kvs)


def _backward_packed(grad, p: Problem):
    grad = grad.contiguous()
    if grad.data_ptr() % 16:
        grad = grad.clone()
    dkvs = torch.empty_like(p.kvs)
    w = p.kvs.shape[1] // 2
    dape = torch.empty_like(p.ape)
    launch_backward(p, grad, dkvs[:, :w], dkvs[:, w:], dape)
    return dkvs, dape


def _packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff):
    return validate_packed(kvs, ape, cu, cuc, total_comp, ratio=ratio, coff=coff, for_kernel=True)


@torch.library.custom_op("csa_compressor::pool_fwd_packed", mutates_args=())
def pool_fwd_packed_op(kvs: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor,
                       cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int,
                       coff: int) -> torch.Tensor:
    return _forward(_packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff))


@pool_fwd_packed_op.register_fake
def _(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff):
    return kvs.new_empty((total_comp, kvs.shape[-1] // (2 * coff)))


@torch.library.custom_op("csa_compressor::pool_bwd_packed", mutates_args=())
def pool_bwd_packed_op(grad: torch.Tensor, kvs: torch.Tensor, ape: torch.Tensor,
                       cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, ratio: int,
                       coff: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_packed(grad, _packed_problem(kvs, ape, cu_seqlens, cu_seqlens_comp,
                                                  grad.shape[0], ratio, coff))


@pool_bwd_packed_op.register_fake
def _(grad, kvs, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    return torch.empty_like(kvs), torch.empty_like(ape)


def _fwd_packed(kvs, ape, cu, cuc, total_comp, ratio, coff):
    if torch.compiler.is_compiling():
        return pool_fwd_packed_op(kvs, ape, cu, cuc, total_comp, ratio, coff)
    return _forward(_packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff))


def _bwd_packed(grad, kvs, ape, cu, cuc, total_comp, ratio, coff):
    if torch.compiler.is_compiling():
        return pool_bwd_packed_op(grad, kvs, ape, cu, cuc, ratio, coff)
    return _backward_packed(grad, _packed_view(kvs, ape, cu, cuc, total_comp, ratio, coff))


class _PackedFn(torch.autograd.Function):
    """The packed op's one autograd path (eager and compiled)."""

    @staticmethod
    def forward(ctx, kvs, ape, cu, cuc, total_comp, ratio, coff):
        ctx.save_for_backward(kvs, ape, cu, cuc)
        ctx.meta = (total_comp, ratio, coff)
        return _fwd_packed(kvs, ape, cu, cuc, total_comp, ratio, coff)

    @staticmethod
    def backward(ctx, grad):
        dkvs, dape = _bwd_packed(grad, *ctx.saved_tensors, *ctx.meta)
        return dkvs, dape, None, None, None, None, None


def compress_thd_fused_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                              check_offsets: bool = False):
    """compress_thd_fused with ``kv`` and ``score`` as the column halves of one tensor
    ``kvs`` ``(T, 2*coff*d)`` (``[kv | score]``, one projection's output): ``(total_comp,
    head_dim)``, differentiable in ``kvs`` (one gradient of its layout) and ``ape``. Needs
    ``coff*d*element size`` a multiple of 16 bytes. Results are bitwise those of
    compress_thd_fused on the two halves."""
    p = validate_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                        coff=coff, for_kernel=True, check_offsets=check_offsets)
    return fused_from_problem(p)


def compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                       deterministic=None, check_offsets: bool = False):
    """Fused gated pooling over a packed THD batch: ``(total_comp, head_dim)``.

    Differentiable in ``kv``, ``score`` and ``ape``. Raises (never falls back) on anything
    the kernels do not support. ``cu_seqlens_comp=None`` derives it on the device.
    ``check_offsets=True`` (or CSA_COMPRESSOR_CHECK_OFFSETS=1) reads the offsets and raises
    on contents that break the layout (one host sync; skipped inside torch.compile and
    graph capture); by default they are not read, and bad contents give unspecified rows,
    never an out-of-bounds access. ``deterministic`` is accepted for API stability: the
    backward is always bitwise reproducible (dape partials are reduced in a fixed order),
    so both settings, and ``torch.use_deterministic_algorithms(True)``, give the same result.
    """
    p = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio, coff=coff,
                 for_kernel=True, check_offsets=check_offsets)
    return fused_from_problem(p)


def fused_from_problem(p: Problem):
    """compress_thd_fused (or its packed form, where the problem came from validate_packed)
    on arguments already validated for the kernels (the dispatch and the module validate
    once and come here)."""
    if p.kvs is not None:
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                p.kvs.requires_grad or p.ape.requires_grad)):
            return _PackedFn.apply(p.kvs, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.total_comp,
                                   p.ratio, p.coff)
        return _forward(p)
    args = (p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.total_comp, p.ratio, p.coff,
            p.head_dim)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            p.kv.requires_grad or p.score.requires_grad or p.ape.requires_grad)):
        return _PoolFn.apply(*args)
    # Nothing to differentiate: skip autograd.Function.apply (~10 µs of host time on the CPU
    # dev machine, a tenth of that for the check).
    return _forward(p)
