"""The public fused ops: the pooling over THD, packed and SBHD inputs, with the epilogue
where asked (``epilogue=``). Each validates once, builds the problem and hands it on whole
(pooling.pool, fused_epilogue.pool_with_epilogue)."""

from __future__ import annotations

from .checks import check_pool_numerics
from .fused_epilogue import EpilogueInside, Finish, pool_with_epilogue
from .pooling import pool, with_numerics
from .validation import Problem, validate, validate_packed, validate_sbhd


def compress_thd_fused_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                              check_offsets: bool = False, score_first: bool = False,
                              numerics: str = "fp32", epilogue=None, norm_weight=None,
                              positions=None, rope_table=None, epilogue_inside=None):
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
    return fused_from_problem(with_numerics(p, numerics),
                              _finish(epilogue, norm_weight, positions, rope_table, epilogue_inside))


def compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                       deterministic=None, check_offsets: bool = False, numerics: str = "fp32",
                       epilogue=None, norm_weight=None, positions=None, rope_table=None, epilogue_inside=None):
    """Fused gated pooling over a packed THD batch: ``(total_comp, head_dim)``.

    Differentiable in ``kv``, ``score`` and ``ape`` (``None``: no position bias, the bits of
    a zero ``ape``, no ``ape`` gradient). Raises (never falls back) on anything
    the kernels do not support. ``cu_seqlens_comp=None`` derives it on the device.
    ``check_offsets=True`` (or CSA_COMPRESSOR_CHECK_OFFSETS=1) reads the offsets and raises
    on contents that break the layout (one host sync; skipped inside torch.compile and
    graph capture); by default a device-side check makes a malformed pack's rows and
    gradients NaN (kernels.launch.ape_read), with no host sync,
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
    ``epilogue_inside`` (an EpilogueInside, or a tuple of directions): which directions run
    as one kernel (default: the forward of short windows; the same bits either way).
    """
    check_pool_numerics(numerics)
    p = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio, coff=coff,
                 for_kernel=True, check_offsets=check_offsets)
    return fused_from_problem(with_numerics(p, numerics),
                              _finish(epilogue, norm_weight, positions, rope_table, epilogue_inside))


def compress_sbhd_fused(kv, score, ape, *, ratio, coff, numerics: str = "fp32", epilogue=None,
                        norm_weight=None, positions=None, rope_table=None, epilogue_inside=None):
    """Fused gated pooling of ``B`` sequences of ``S`` tokens in the SBHD layout: ``kv`` and
    ``score`` ``(S, B, coff*d)`` -> ``(S // ratio, B, head_dim)`` (no rows where S < ratio).
    The kernels read the strided token rows in place (no transposed copy); results are
    bitwise those of compress_thd_fused on the sequences packed one after another.
    Differentiable in ``kv``, ``score`` and ``ape``; needs ``coff*d*element size`` and
    ``d*element size`` multiples of 16 bytes. ``numerics`` and ``epilogue``: as
    compress_thd_fused's (the positions default to ``row * ratio``, ``(n * B,)`` in the
    rows' ``(n, B)`` order)."""
    check_pool_numerics(numerics)
    return fused_from_problem(with_numerics(validate_sbhd(kv, score, ape, ratio=ratio, coff=coff,
                                                  for_kernel=True), numerics),
                              _finish(epilogue, norm_weight, positions, rope_table, epilogue_inside))


def compress_sbhd_fused_packed(kvs, ape, *, ratio, coff, score_first: bool = False,
                               numerics: str = "fp32", epilogue=None, norm_weight=None,
                               positions=None, rope_table=None, epilogue_inside=None):
    """compress_sbhd_fused with ``kv`` and ``score`` as the column halves of one tensor
    ``kvs`` ``(S, B, 2*coff*d)`` (one projection's output; ``[score | kv]`` where
    ``score_first``), its gradient one tensor of that layout."""
    check_pool_numerics(numerics)
    return fused_from_problem(with_numerics(validate_sbhd(kvs, None, ape, ratio=ratio, coff=coff,
                                                  for_kernel=True, packed=True,
                                                  score_first=score_first), numerics),
                              _finish(epilogue, norm_weight, positions, rope_table, epilogue_inside))


def _finish(epilogue, norm_weight, positions, rope_table, epilogue_inside):
    """The ops' epilogue arguments as a fused_epilogue.Finish (None: no epilogue)."""
    if epilogue is None:
        for name, v in (("norm_weight", norm_weight), ("positions", positions),
                        ("rope_table", rope_table)):
            if v is not None:
                raise ValueError(f"{name}: given without epilogue=")
        return None
    return Finish(epilogue, norm_weight, positions, rope_table=rope_table,
                  inside=EpilogueInside.of(epilogue_inside))


def fused_from_problem(p: Problem, finish: Finish | None = None):
    """The fused op on arguments already validated for the kernels (validate,
    validate_packed or validate_sbhd: the dispatch and the module validate once and come
    here). With a ``finish`` (fused_epilogue.Finish), the epilogue's output."""
    return pool(p) if finish is None else pool_with_epilogue(p, finish)
