"""Launches on a validated problem (validation.Problem) into checked buffers: the kernels
are found in the compile cache and each launch sized from the kernel and the pack."""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from . import plan
from .compile import compiled_for, is_compiled
from .hardware import sm_count
from .offsets import guarded_ape
from .tuning import current


@functools.cache  # asked at the first launch; the visible devices do not change after
def _one_gpu() -> bool:
    return torch.cuda.device_count() == 1


_CURRENT = contextlib.nullcontext()  # reentrant: one for every launch


def on_device(dev):
    """``torch.cuda.device(dev)`` only when ``dev`` is not already current (the guard costs
    microseconds of host time on every call otherwise). With one visible GPU it is always
    current, and even the check (``torch.cuda.current_device()``, 0.7 µs on the H200 host)
    is skipped."""
    if dev.type != "cuda" or _one_gpu() or dev.index == torch.cuda.current_device():
        return _CURRENT
    return torch.cuda.device(dev)


def ape_read(p):
    """The APE the pooling kernels read: of a THD pack, a copy that is NaN where its
    offsets are malformed (offsets.OffsetsGuard; SBHD packs have no caller offsets), so
    bad offsets give NaN rows and gradients by default, with no host sync. Without an APE
    (p.has_ape False) the same guard's flag, 0 or NaN in every element, which the
    kernels read in its place. SBHD packs and packs whose offsets the package built
    (p.offsets_built) have nothing to check: the APE as it is, or zeros. Made once a
    problem (p.read_ape)."""
    if p.read_ape is not None:
        return p.read_ape
    shape = (p.ratio, p.kv.shape[1])
    if p.batch or p.offsets_built:
        read = p.ape if p.has_ape else torch.zeros(shape, dtype=torch.float32, device=p.kv.device)
    else:
        read = guarded_ape(p.cu_seqlens, p.cu_seqlens_comp, p.ape, p.num_tokens, p.total_comp,
                           p.ratio, shape)
    p.read_ape = read
    return read


def forward_kernel(p, epilogue=None):
    """(compiled forward, SM count) of problem ``p``'s specialisation (``epilogue``: as
    launch_forward's): what each launch looks up, for a caller that keeps it."""
    dev = p.kv.device
    c = compiled_for(plan.spec("fwd", p.kv.dtype, p.ratio, p.coff, p.head_dim, p.tuning,
                               row_stride=p.row_stride, batch=p.batch, numerics=p.numerics,
                               epilogue=epilogue, ape=p.has_ape), dev)
    return c, sm_count(dev.index)


def launch_found(found, tuning, num_rows, kv, score, ape, cu, cuc, out, extra=()):
    """Launch forward_kernel's ``found`` for a pack of ``num_rows`` rows (``ape``: as the
    kernels read it, ape_read)."""
    c, sms = found
    rows = c.kernel.rows_per_thread(num_rows, sms, c.ctas_per_sm, tuning)
    c.fn(kv, score, ape, cu, cuc, out, rows, *extra)
    return out


def launch_kept(found, tuning, num_rows, kv, score, ape, cu, cuc, out):
    """launch_found on ``kv``'s device, for a caller that keeps ``found`` (forward_kernel)
    between launches."""
    with on_device(kv.device):
        return launch_found(found, tuning, num_rows, kv, score, ape, cu, cuc, out)


def launch_forward(p, out, epilogue=None, extra=()):
    """Forward launch on a validated problem into a checked ``out``. ``epilogue`` (an
    EpilogueKey): the kernel with the epilogue inside (pool_epilogue), ``extra`` its
    arguments after the pooling's (the rows flat, their statistics, the weight, cos, sin,
    the output)."""
    if p.total_comp == 0:
        return out
    with on_device(p.kv.device):
        launch_found(forward_kernel(p, epilogue), p.tuning, p.total_comp, p.kv, p.score,
                     ape_read(p), p.cu_seqlens, p.cu_seqlens_comp, out, extra)
    return out


def backward_schedule(total_comp: int, num_tokens: int, kernel, device: torch.device,
                      ctas_per_sm: int | None = None):
    """(rows per row-CTA, row CTAs, zero-fill CTAs) for one backward launch (a sequence's,
    for each grid.z one of an SBHD launch), its row CTAs one wave of ``ctas_per_sm`` an SM
    (the compiled kernel's; the design's without one)."""
    ctas = ctas_per_sm or kernel.target_ctas_per_sm
    target = max(1, sm_count(device.index) * ctas // (kernel.col_groups * kernel.grid_z()))
    rows_per_cta = max(kernel.min_rows_per_cta, math.ceil(total_comp / target))
    tokens_per_cta = kernel.row_lanes * kernel.t.ZERO_TOKENS_PER_THREAD
    return (rows_per_cta, math.ceil(total_comp / rows_per_cta), math.ceil(num_tokens / tokens_per_cta))


def backward_kernel(device, dtype, ratio, coff, head_dim, total_comp, row_stride: int = 0,
                    batch: int = 0, numerics: str = "fp32", epilogue=None, tuning=None,
                    fp32_dscore: bool = False, ape: bool = True):
    """The compiled backward for a pack of ``total_comp`` rows (each of ``batch`` SBHD
    sequences): the large-pack variant where the kernel has one (pool_bwd ``large``), from
    BWD_LARGE_PACK_ROWS rows in all, or from BWD_LARGE_GUESS_PACK_ROWS where that variant
    copies its first row at a guess."""
    t = tuning or current()
    c = compiled_for(plan.spec("bwd", dtype, ratio, coff, head_dim, t, row_stride=row_stride,
                               batch=batch, numerics=numerics, epilogue=epilogue,
                               fp32_dscore=fp32_dscore, ape=ape), device)
    rows = t.BWD_LARGE_PACK_ROWS
    if c.kernel.large_guesses:
        rows = min(rows, t.BWD_LARGE_GUESS_PACK_ROWS)
    if c.large is not None and total_comp * max(batch, 1) >= rows:
        return c.large
    return c


def backward_plan(device, dtype, ratio, coff, head_dim, total_comp, num_tokens, row_stride: int = 0,
                  batch: int = 0, numerics: str = "fp32", epilogue=None, tuning=None,
                  fp32_dscore: bool = False, ape: bool = True):
    """(compiled backward, backward_schedule, shape of its fp32 dape partials) of one
    backward launch. A kernel with the epilogue inside takes the plain backward's schedule:
    the APE gradient sums the row CTAs' partials, so the same row CTAs keep that sum in the
    pooling op's order (its own registers may leave fewer CTAs an SM)."""
    c = backward_kernel(device, dtype, ratio, coff, head_dim, total_comp, row_stride, batch,
                        numerics, epilogue, tuning, fp32_dscore, ape)
    sized = c if epilogue is None else backward_kernel(device, dtype, ratio, coff, head_dim,
                                                       total_comp, row_stride, batch, numerics,
                                                       tuning=tuning, ape=ape)
    schedule = backward_schedule(total_comp, num_tokens, sized.kernel, device, sized.ctas_per_sm)
    return c, schedule, (schedule[1] * ratio * c.kernel.grid_z(), coff * head_dim)


def dape_sum(c, rows: int, tuning=None):
    """The backward's compiled dape sum for ``rows`` partial rows: the wide layout for few
    rows where the partials have the columns for it (REDUCE_WIDE_*)."""
    if c.dape_wide is not None and rows <= (tuning or current()).REDUCE_WIDE_MAX_ROWS:
        return c.dape_wide
    return c.dape


def launch_backward(p, grad_out, grad_kv, grad_score, grad_ape, workspace=None, epilogue=None,
                    extra=()):
    """Backward launch on a validated problem into checked buffers (an SBHD problem's:
    sequence 0's views of them, rows and tokens present; ops.py zero-fills the rest).
    ``epilogue`` (an EpilogueKey): the kernel with the epilogue's backward inside, which
    writes ``grad_out`` itself before reading it; ``extra`` its arguments after the
    pooling's (the output's gradient, the rows, their statistics, the weight, cos, sin,
    ``grad_out`` flat, the weight's products). A float32 ``grad_score`` for narrower
    inputs takes dscore unrounded (plan.KernelSpec.fp32_dscore)."""
    dev, dt, N, T, d, ratio, coff = (p.kv.device, p.kv.dtype, p.total_comp, p.num_tokens,
                                     p.head_dim, p.ratio, p.coff)
    if N == 0 or T == 0:
        # no rows or no tokens: zeros, or NaN where the offsets are malformed
        fill = None
        if p.batch == 0 and not p.offsets_built:
            with on_device(dev):
                fill = ape_read(p).view(-1)[:1] * 0
        for g in (grad_kv, grad_score, grad_ape):
            g.zero_() if fill is None else g.copy_(fill.view([1] * g.dim()).expand(g.shape))
        return grad_kv, grad_score, grad_ape
    with on_device(dev):
        fp32_dscore = grad_score.dtype == torch.float32 and dt != torch.float32
        c, (rows_per_cta, row_ctas, zero_ctas), shape = backward_plan(dev, dt, ratio, coff, d, N, T,
                                                                      p.row_stride, p.batch,
                                                                      p.numerics, epilogue,
                                                                      p.tuning, fp32_dscore,
                                                                      p.has_ape)
        if workspace is None:
            # no position bias: the kernels write no dape partials, one row stands in
            workspace = torch.empty(shape if p.has_ape else (1, shape[1]), dtype=torch.float32,
                                    device=dev)
        elif tuple(workspace.shape) != shape:
            raise ValueError(f"workspace: expected shape {shape}, got {tuple(workspace.shape)}")
        c.fn(p.kv, p.score, ape_read(p), p.cu_seqlens, p.cu_seqlens_comp, grad_out, grad_kv,
             grad_score, workspace, rows_per_cta, row_ctas, zero_ctas, *extra)
        if not p.has_ape:  # no position bias: no dape partials, no sum
            return grad_kv, grad_score, grad_ape
        sum_dape(c, row_ctas, workspace, grad_ape, p.tuning)
    return grad_kv, grad_score, grad_ape


def sum_dape(c, row_ctas: int, workspace, grad_ape, tuning=None) -> None:
    """Backward ``c``'s dape partials (``workspace``, written by its ``row_ctas`` row CTAs)
    summed into ``grad_ape`` in a fixed order (dape_reduce.py; torch.sum took 12-15 us
    here), in the layout for this many partial rows."""
    rows, C = row_ctas * c.kernel.grid_z(), grad_ape.numel()
    dape_sum(c, rows, tuning)(workspace.view(rows, C), grad_ape.view(1, C))


def decode_kernel(device, dtype, ratio, coff, head_dim, numerics="fp32", tuning=None):
    """The compiled decode step (pool_decode) of this specialisation; None where it has
    none, or where it is not compiled yet and a CUDA graph captures (the caller then takes
    its torch ops, the same bits)."""
    t = tuning or current()
    if not plan.decode_designable(dtype, ratio, coff, head_dim, t):
        return None
    s = plan.spec("decode", dtype, ratio, coff, head_dim, t, numerics=numerics)
    if torch.cuda.is_current_stream_capturing() and not is_compiled(s, device):
        return None
    return compiled_for(s, device)


def launch_decode(c, rings, new, ape, slots, state, outs, next_n: int, history: int, limit: int):
    """One decode step of compiled ``c`` (decode_kernel): ``rings`` (kv, score) ``(slots *
    history, W)``, ``new`` (kv, score) ``(entries * next_n, W)``, ``state`` (counts, last
    steps, bad flags as uint8), ``outs`` (rows, emitted as uint8, positions)."""
    with on_device(rings[0].device):
        c.fn(*rings, *new, ape, slots, *state, *outs, next_n, history, limit)
