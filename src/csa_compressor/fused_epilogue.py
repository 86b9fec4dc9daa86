"""The fused pooling followed by the epilogue, as one op, bitwise the pooling op followed
by ``apply_epilogue``: on the GPU a direction its EpilogueInside names runs as one kernel
(kernels.pool_epilogue: the pooling kernel with the epilogue's row math inside); the
others, and problems those kernels do not take (too few rows for the norm's in-kernel
statistics; a gradient in another dtype; geometries the row math does not cover), run the
pooling kernels and the epilogue's own kernels in turn (by parts: the same bits). Under
torch.compile the node's two directions are custom ops, as the pooling's are.

The ops take it as ``epilogue=``: ``compress_thd_fused(..., epilogue=Epilogue(...),
norm_weight=w)`` and the packed and SBHD ops likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import halves, kernel_aligned
from .epilogue import Epilogue, check_rope_table, rope_cos_sin, rope_positions, sbhd_positions
from .epilogue_op import (apply_epilogue, backward_rows, column_sum, ep_args, ep_of,
                          forward_rows, norm_in_kernel)
from .kernels import hardware, launch, plan
from .kernels.compile import epilogue_designable, is_compiled
from .kernels.jit import placeholder
from .kernels.tuning import current
from . import pooling
from .pooling import packed_problem, problem
from .runtime import small_kernels_usable
from .softmax_order import ROWSUM_MIN_ROWS
from .validation import Problem


DIRECTIONS = ("fwd", "bwd")


def _directions(name: str, value) -> tuple:
    if isinstance(value, str) or not isinstance(value, (tuple, list, set, frozenset)) \
            or any(v not in DIRECTIONS for v in value):
        raise ValueError(f"{name}: expected a tuple of directions from {DIRECTIONS}, got "
                         f"{value!r}")
    return tuple(v for v in DIRECTIONS if v in value)


@dataclass(frozen=True)
class EpilogueInside:
    """Which directions (``"fwd"``, ``"bwd"``) of the pooling + epilogue op run as one
    kernel, the pooling kernel with the epilogue inside, where that kernel takes the
    problem: ``short`` for windows of at most 16 slots, ``long`` for longer ones. The
    others run the pooling kernel and the epilogue kernel in turn: the same bits either
    way. The default is what measured faster on the H200: the forward inside at ratio 4
    (1.4-2.0 µs faster), every other direction by parts (the one-kernel versions 1.3-4 µs
    slower: BENCHMARKS.md)."""

    short: tuple = ("fwd",)
    long: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "short", _directions("short", self.short))
        object.__setattr__(self, "long", _directions("long", self.long))

    @classmethod
    def of(cls, value) -> "EpilogueInside":
        """``value`` as an EpilogueInside: None (the default), one, or a tuple of directions
        for short and long windows alike."""
        if value is None:
            return DEFAULT_INSIDE
        if isinstance(value, cls):
            return value
        if isinstance(value, (tuple, list, set, frozenset)):
            d = _directions("epilogue_inside", value)
            return cls(d, d)
        raise TypeError(f"epilogue_inside: expected None, a csa_compressor.EpilogueInside or a "
                        f"tuple of directions from {DIRECTIONS}, got {type(value).__name__}")

    def bits(self) -> int:
        """The custom ops' scalar: bit i the i-th direction short, bit 2+i long."""
        return sum(1 << i for i, d in enumerate(DIRECTIONS) if d in self.short) + \
            sum(4 << i for i, d in enumerate(DIRECTIONS) if d in self.long)

    @classmethod
    def of_bits(cls, bits: int) -> "EpilogueInside":
        return cls(tuple(d for i, d in enumerate(DIRECTIONS) if bits >> i & 1),
                   tuple(d for i, d in enumerate(DIRECTIONS) if bits >> (2 + i) & 1))


DEFAULT_INSIDE = EpilogueInside()


class Finish:
    """The epilogue after a pooling: its settings, the norm weight, the rows' positions
    (None: the layout's, ``block_index * ratio``), the rotary frequencies where the caller
    keeps them, or a caller's ``(cos, sin)`` table."""

    __slots__ = ("ep", "norm_weight", "positions", "inv_freq", "rope_table", "inside", "_key")

    def __init__(self, ep, norm_weight, positions=None, inv_freq=None, rope_table=None,
                 inside: EpilogueInside | None = None):
        self.ep, self.norm_weight, self.positions = ep, norm_weight, positions
        self.inv_freq, self.rope_table, self._key = inv_freq, rope_table, None
        self.inside = EpilogueInside.of(inside)

    def check(self, p: Problem) -> "Finish":
        """The arguments checked against the pooling's problem (as apply_epilogue checks
        them), the positions made where not given."""
        ep, w, d = self.ep, self.norm_weight, p.head_dim
        if not isinstance(ep, Epilogue):
            raise TypeError(f"epilogue: expected a csa_compressor.Epilogue, got {type(ep).__name__}")
        ep.check(d)
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"norm_weight: expected a torch.Tensor with epilogue=, got "
                            f"{type(w).__name__}")
        if not w.is_floating_point() or tuple(w.shape) != (d,) or w.device != p.kv.device:
            raise ValueError(f"norm_weight: expected a floating-point ({d},) tensor on "
                             f"{p.kv.device}, got {w.dtype} {tuple(w.shape)} on {w.device}")
        rows = p.total_comp * max(p.batch, 1)
        pos = self.positions
        if pos is None:
            pos = (sbhd_positions(p.total_comp, p.batch, p.ratio, p.kv.device) if p.batch
                   else rope_positions(p.cu_seqlens_comp, p.total_comp, p.ratio))
        elif not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex() \
                or tuple(pos.shape) != (rows,) or pos.device != p.kv.device:
            raise ValueError(f"positions: expected ({rows},) integer positions on {p.kv.device}, "
                             f"got {getattr(pos, 'dtype', type(pos).__name__)} "
                             f"{tuple(getattr(pos, 'shape', ()))}")
        table = self.rope_table
        if table is not None:
            table = check_rope_table(table, ep.rope_dim, p.kv.device)
        return Finish(ep, w, pos, self.inv_freq, table, self.inside)

    def apply(self, pooled: torch.Tensor) -> torch.Tensor:
        """The epilogue node on ``pooled`` (any shape whose last dim is head_dim)."""
        rows = apply_epilogue(pooled.reshape(-1, pooled.shape[-1]), self.norm_weight,
                              self.positions, self.ep, self.inv_freq, self.rope_table)
        return rows.view(pooled.shape)

    def key(self):
        """The kernels' EpilogueKey (asked at each decision and launch of a call: made once)."""
        if self._key is None:
            self._key = plan.EpilogueKey.of(self.ep, self.norm_weight.dtype)
        return self._key


def _rows(p: Problem, t):
    return t[:, 0] if p.batch else t


def _in_kernels(p: Problem, f: Finish, flat: torch.Tensor, direction: str) -> bool:
    """Whether ``direction`` runs in the pooling kernels with the epilogue inside: it is in
    ``f.inside.short`` (``.long`` for long windows), the design takes the problem
    (catalog.epilogue_designable), and the norm's
    statistics run in the kernel (epilogue_op.norm_in_kernel: enough rows, its order checked
    torch's)."""
    inside = f.inside.long if (p.tuning or current()).long_window(p.ratio * p.coff) else f.inside.short
    if direction not in inside or flat.shape[0] < ROWSUM_MIN_ROWS or p.num_tokens == 0 \
            or not small_kernels_usable(flat):
        return False
    if not epilogue_designable(p.kv.dtype, p.ratio, p.coff, p.head_dim,
                                    hardware.target_major(), (p.tuning or current()).codegen(), p.row_stride,
                                    p.batch, p.numerics, f.key()):
        return False
    if torch.cuda.is_current_stream_capturing():
        # a kernel first asked for while a graph captures cannot compile: by parts instead
        # (the backward also sizes its grid by the plain backward's: launch.backward_plan)
        keys = (f.key(),) if direction == "fwd" else (f.key(), None)
        for key in keys:
            spec = plan.spec(direction, p.kv.dtype, p.ratio, p.coff, p.head_dim, p.tuning,
                             row_stride=p.row_stride, batch=p.batch, numerics=p.numerics,
                             epilogue=key)
            if not is_compiled(spec, flat.device):
                return False
    return norm_in_kernel(flat, f.norm_weight, f.ep)


def _pooled_buffer(p: Problem) -> torch.Tensor:
    d = p.head_dim
    shape = (p.total_comp, p.batch, d) if p.batch else (p.total_comp, d)
    return torch.empty(shape, dtype=p.kv.dtype, device=p.kv.device)


def _cos_sin_args(f: Finish, cos, sin, d, device):
    """What the kernels take for the rotary rows: the tables, or a placeholder pair."""
    if cos is not None:
        return cos, sin
    from .kernels.epilogue_rows import cos_sin_vec  # the kernels need the DSL: only here

    ph = placeholder((1, cos_sin_vec(d, f.ep.rope_interleaved)), torch.float32, device)
    return ph, ph


def _forward(p: Problem, f: Finish):
    """``(y, pooled, r, cos, sin)``: by the kernels with the epilogue inside where they take
    the problem, else by the pooling kernels and the epilogue node's forward in turn."""
    d = p.head_dim
    pooled = _pooled_buffer(p)
    flat = pooled.view(-1, d)
    if not _in_kernels(p, f, flat, "fwd"):
        launch.launch_forward(p, _rows(p, pooled))
        y, r, cos, sin = forward_rows(flat, f.norm_weight, f.positions, f.inv_freq, f.ep,
                                           f.rope_table)
        return y.view(pooled.shape), pooled, r, cos, sin
    cos = sin = None
    if f.ep.rope_dim:
        cos, sin = (kernel_aligned(t) for t in rope_cos_sin(f.positions, f.ep, f.inv_freq,
                                                            f.rope_table))
    r = torch.empty((flat.shape[0], 1), dtype=torch.float32, device=flat.device)
    y = torch.empty_like(flat)
    counts = ()
    if (p.tuning or current()).long_window(p.ratio * p.coff):  # a row over CTAs: the last one finishes it
        counts = (torch.zeros(flat.shape[0], dtype=torch.int32, device=flat.device),)
    launch.launch_forward(p, _rows(p, pooled), f.key(),
                   (flat, r, kernel_aligned(f.norm_weight),
                    *_cos_sin_args(f, cos, sin, d, flat.device), y) + counts)
    return y.view(pooled.shape), pooled, r, cos, sin


def _backward(p: Problem, f: Finish, gy, pooled, r, cos, sin):
    """``(grads of the pooling's inputs..., dape, the weight's gradient)``: by the kernels
    with the epilogue inside or by parts (either after either forward)."""
    d = p.head_dim
    flat = pooled.view(-1, d)
    grads = ((torch.empty_like(p.kvs),) if p.kvs is not None
             else tuple(torch.empty_like(t) for t in (p.full or (p.kv, p.score))))
    views = halves(grads[0], p.score_first) if p.kvs is not None else grads
    g = gy.reshape(flat.shape)
    if g.dtype != flat.dtype or not _in_kernels(p, f, flat, "bwd"):
        gx, gw = backward_rows(g, flat, f.norm_weight, cos, sin, r, f.ep)
        dape = pooling.launch_backward_into(gx.view(pooled.shape), p, views)
        return grads + (dape, gw)
    gx = torch.empty_like(pooled)
    aux = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    dape = torch.empty_like(p.ape)
    launch.launch_backward(p, _rows(p, gx), *(_rows(p, v) for v in views), dape, epilogue=f.key(),
                    extra=(kernel_aligned(g), flat, r, kernel_aligned(f.norm_weight),
                           *_cos_sin_args(f, cos, sin, d, flat.device), gx.view(-1, d), aux))
    return grads + (dape, column_sum(aux).to(f.norm_weight.dtype))


# Under torch.compile the node's directions are custom ops (opaque: the compiled graph runs
# the same launches). A problem travels as the pooling ops' arguments (``kvs`` None: kv and
# score apart; the offsets None: SBHD), the epilogue as apply_epilogue's op's scalars.

def _op_problem(kv, score, kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics):
    if kvs is not None:
        return packed_problem(kvs, ape, cu, cuc, total_comp, ratio, coff, score_first, numerics)
    return problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, numerics)


def _op_finish(weight, positions, inv_freq, cos_table, sin_table, args, inside: int):
    table = None if cos_table is None else (cos_table, sin_table)
    return Finish(ep_of(*args), weight, positions, inv_freq, table,
                  EpilogueInside.of_bits(inside))


@torch.library.custom_op("csa_compressor::pool_epilogue_fwd", mutates_args=())
def pool_epilogue_fwd_op(kv: torch.Tensor | None, score: torch.Tensor | None,
                         kvs: torch.Tensor | None, ape: torch.Tensor, cu_seqlens: torch.Tensor | None,
                         cu_seqlens_comp: torch.Tensor | None, total_comp: int, ratio: int,
                         coff: int, score_first: bool, numerics: str, weight: torch.Tensor,
                         positions: torch.Tensor, inv_freq: torch.Tensor | None,
                         cos_table: torch.Tensor | None, sin_table: torch.Tensor | None,
                         eps: float, rope_dim: int, rope_theta: float, interleaved: bool,
                         yarn: list[float], rotate: bool, inside: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:
    p = _op_problem(kv, score, kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                    score_first, numerics)
    f = _op_finish(weight, positions, inv_freq, cos_table, sin_table,
                   (eps, rope_dim, rope_theta, interleaved, yarn, rotate), inside)
    y, pooled, r, cos, sin = _forward(p, f)
    if cos is None:  # an op returns tensors: empty ones where there is no rotary table
        cos, sin = (r.new_empty((0, 0)) for _ in range(2))
    return y, pooled, r, cos, sin


@pool_epilogue_fwd_op.register_fake
def _(kv, score, kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, score_first,
      numerics, weight, positions, inv_freq, cos_table, sin_table, eps, rope_dim, rope_theta,
      interleaved, yarn, rotate, inside):
    t = kvs if kvs is not None else kv
    d = t.shape[-1] // (2 * coff if kvs is not None else coff)
    shape = (total_comp, t.shape[1], d) if cu_seqlens is None else (total_comp, d)
    rows = positions.shape[0]
    n = rows if rope_dim else 0
    cs = t.new_empty((n, rope_dim // 2), dtype=torch.float32)
    return (t.new_empty(shape), t.new_empty(shape), t.new_empty((rows, 1), dtype=torch.float32),
            cs, torch.empty_like(cs))


@torch.library.custom_op("csa_compressor::pool_epilogue_bwd", mutates_args=())
def pool_epilogue_bwd_op(g: torch.Tensor, kv: torch.Tensor | None, score: torch.Tensor | None,
                         kvs: torch.Tensor | None, ape: torch.Tensor,
                         cu_seqlens: torch.Tensor | None, cu_seqlens_comp: torch.Tensor | None,
                         total_comp: int, ratio: int, coff: int, score_first: bool,
                         numerics: str, weight: torch.Tensor, positions: torch.Tensor,
                         pooled: torch.Tensor, r: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, eps: float, rope_dim: int, rope_theta: float,
                         interleaved: bool, yarn: list[float], rotate: bool, inside: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _op_problem(kv, score, kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
                    score_first, numerics)
    f = _op_finish(weight, positions, None, None, None,
                   (eps, rope_dim, rope_theta, interleaved, yarn, rotate), inside)
    if not rope_dim:
        cos = sin = None
    grads = _backward(p, f, g, pooled, r, cos, sin)
    if len(grads) == 3:  # packed: one input gradient (the second an empty placeholder)
        grads = (grads[0], ape.new_empty((0,))) + grads[1:]
    return tuple(grads)


@pool_epilogue_bwd_op.register_fake
def _(g, kv, score, kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff, score_first,
      numerics, weight, positions, pooled, r, cos, sin, eps, rope_dim, rope_theta, interleaved,
      yarn, rotate, inside):
    if kvs is not None:
        return (torch.empty_like(kvs), ape.new_empty((0,)), torch.empty_like(ape),
                torch.empty_like(weight))
    return (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape),
            torch.empty_like(weight))


def _op_args(p: Problem) -> tuple:
    """The pooling's tensors as the custom ops take them (SBHD: the caller's tensors, no
    offsets) and its scalars."""
    cu, cuc = (None, None) if p.batch else (p.cu_seqlens, p.cu_seqlens_comp)
    if p.kvs is not None:
        kv = score = None
    else:
        kv, score = p.full or (p.kv, p.score)
    return (kv, score, p.kvs, p.ape, cu, cuc), (p.total_comp, p.ratio, p.coff, p.score_first,
                                                 p.numerics)


class _PoolEpilogueFn(torch.autograd.Function):
    """The pooling and the epilogue as one node, differentiable in the pooling's inputs,
    the APE and the norm weight (eager calls: the problem travels as it is)."""

    @staticmethod
    def forward(ctx, p, f, ape, weight, *inputs):
        y, pooled, r, cos, sin = _forward(p, f)
        ctx.p, ctx.f = p, f
        ctx.save_for_backward(pooled, r, cos, sin)
        return y

    @staticmethod
    def backward(ctx, gy):
        pooled, r, cos, sin = ctx.saved_tensors
        *dinputs, dape, dw = _backward(ctx.p, ctx.f, gy, pooled, r, cos, sin)
        return (None,) * 2 + (dape, dw) + tuple(dinputs)


class _PoolEpilogueOpFn(torch.autograd.Function):
    """The same node under torch.compile: tensors and scalars only, each direction one
    custom op."""

    @staticmethod
    def forward(ctx, kv, score, kvs, ape, cu, cuc, weight, positions, inv_freq, cos_table,
                sin_table, meta, ep, inside):
        y, pooled, r, cos, sin = pool_epilogue_fwd_op(kv, score, kvs, ape, cu, cuc, *meta,
                                                      weight, positions, inv_freq, cos_table,
                                                      sin_table, *ep_args(ep), inside)
        ctx.save_for_backward(kv, score, kvs, ape, cu, cuc, weight, positions, pooled, r, cos,
                              sin)
        ctx.meta, ctx.ep, ctx.inside = meta, ep, inside
        return y

    @staticmethod
    def backward(ctx, gy):
        kv, score, kvs, ape, cu, cuc, weight, positions, pooled, r, cos, sin = ctx.saved_tensors
        a, b, dape, dw = pool_epilogue_bwd_op(gy, kv, score, kvs, ape, cu, cuc, *ctx.meta, weight,
                                              positions, pooled, r, cos, sin, *ep_args(ctx.ep),
                                              ctx.inside)
        grads = (None, None, a) if kvs is not None else (a, b, None)
        return grads + (dape, None, None, dw) + (None,) * 7


def pool_with_epilogue(p: Problem, f: Finish) -> torch.Tensor:
    """The fused pooling of a validated problem followed by the epilogue: the pooled rows'
    shape (``(N, d)``, SBHD ``(n, B, d)``), the input dtype."""
    f = f.check(p)
    if torch.compiler.is_compiling():
        tensors, meta = _op_args(p)
        table = f.rope_table or (None, None)
        return _PoolEpilogueOpFn.apply(*tensors, f.norm_weight, f.positions, f.inv_freq, *table,
                                       meta, f.ep, f.inside.bits())
    inputs = (p.kvs,) if p.kvs is not None else (p.full or (p.kv, p.score))
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs + (p.ape, f.norm_weight)):
        return _PoolEpilogueFn.apply(p, f, p.ape, f.norm_weight, *inputs)
    return _forward(p, f)[0]
