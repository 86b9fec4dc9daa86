"""The kernel-level API (PoolPlan: a pack's checks and plans made once, for many runs):
caller-provided buffers (allocated here: the dape workspace where
none is passed, and the offsets check's small APE copy), each its own memory (no output
may share a byte with an input or another output), safe to capture in CUDA graphs once
compiled (``precompile`` first)."""

from __future__ import annotations

import torch

from .checks import (check_cuda_device, check_disjoint, check_flag, check_int, check_out,
                     check_pool_numerics, check_specialisation)
from .epilogue import Epilogue
from .kernels import compile as _compile
from .kernels.launch import backward_plan, launch_backward, launch_forward
from .kernels.plan import EpilogueKey
from .kernels.tuning import Tuning
from .pool_plan import PoolPlan
from .validation import validate

__all__ = ["PoolPlan", "backward_workspace_shape", "pool_backward", "pool_forward", "precompile"]


def _problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, coff,
             check_offsets=False, numerics="fp32", tuning=None):
    check_pool_numerics(numerics)
    p = validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio=ratio,
                 coff=coff, for_kernel=True, check_offsets=check_offsets)
    p.numerics, p.tuning = numerics, _tuning(tuning)
    return p


def _inputs(p, *more) -> tuple:
    """``(name, tensor)`` of what the kernels read, for check_disjoint."""
    return (("kv", p.kv), ("score", p.score), ("ape", p.ape), ("cu_seqlens", p.cu_seqlens),
            ("cu_seqlens_comp", p.cu_seqlens_comp)) + more


def _tuning(tuning):
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected None or a kernels.tuning.Tuning, got {type(tuning).__name__}")
    return tuning


def pool_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, *, ratio: int, coff: int,
                 check_offsets: bool = False, numerics: str = "fp32", tuning=None):
    """Write the pooled rows into ``out`` ``(N, d)`` (N = out.shape[0] = total_comp).
    ``check_offsets`` and ``numerics``: as compress_thd_fused's. ``tuning`` (a
    kernels.tuning.Tuning): build and launch with it instead of the process's."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    p = _problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, out.shape[0], ratio, coff,
                 check_offsets, numerics, tuning)
    check_out("out", out, (p.total_comp, p.head_dim), p.kv.dtype, p.kv.device)
    check_disjoint((("out", out),), _inputs(p))
    return launch_forward(p, out)


def backward_workspace_shape(total_comp, num_tokens, ratio, coff, head_dim, dtype, device,
                             numerics: str = "fp32", tuning=None):
    """Shape of the fp32 dape partials the backward needs (pass one as ``workspace``); the
    backward's ``numerics`` compile their own kernel, whose grid may differ."""
    check_specialisation(dtype, ratio, coff, head_dim)
    check_int("total_comp", total_comp, 0)
    check_int("num_tokens", num_tokens, 0)
    check_pool_numerics(numerics)
    return backward_plan(check_cuda_device(device), dtype, ratio, coff, head_dim, total_comp,
                         num_tokens, numerics=numerics, tuning=_tuning(tuning))[2]


def pool_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                  grad_ape, *, ratio: int, coff: int, workspace=None, check_offsets: bool = False,
                  numerics: str = "fp32", tuning=None):
    """Write every element of ``grad_kv``/``grad_score`` (may start uninitialised) and
    ``grad_ape`` (fp32; None where ``ape`` is None). Gradients on padding rows are ignored. The result is bitwise
    reproducible: dape partials are reduced in a fixed order, never with atomics.
    ``check_offsets`` and ``numerics``: as compress_thd_fused's (a ``workspace`` then of
    backward_workspace_shape(..., numerics=numerics)). ``grad_score`` may be float32 for
    bf16 / fp16 inputs: dscore before its rounding (the value the kernel rounds into a
    grad_score of kv's dtype), for callers that reduce it in an order of their own."""
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out: expected a torch.Tensor, got {type(grad_out).__name__}")
    p = _problem(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out.shape[0], ratio, coff,
                 check_offsets, numerics, tuning)
    dev, dt, N, d = p.kv.device, p.kv.dtype, p.total_comp, p.head_dim
    check_out("grad_out", grad_out, (N, d), dt, dev)
    check_out("grad_kv", grad_kv, tuple(p.kv.shape), dt, dev)
    score_dt = torch.float32 if getattr(grad_score, "dtype", None) == torch.float32 else dt
    check_out("grad_score", grad_score, tuple(p.kv.shape), score_dt, dev)
    if p.has_ape:
        check_out("grad_ape", grad_ape, tuple(p.ape.shape), torch.float32, dev)
    elif grad_ape is not None:
        raise ValueError("grad_ape: expected None where ape is None (no position bias: no "
                         f"gradient to write), got {type(grad_ape).__name__}")
    else:
        grad_ape = p.ape
    if workspace is not None:
        check_out("workspace", workspace, workspace.shape, torch.float32, dev)
    check_disjoint((("grad_kv", grad_kv), ("grad_score", grad_score), ("grad_ape", grad_ape),
                    ("workspace", workspace)), _inputs(p, ("grad_out", grad_out)))
    return launch_backward(p, grad_out, grad_kv, grad_score, grad_ape, workspace)


def precompile(dtype: torch.dtype, ratio: int, coff: int, head_dim: int, device=None,
               directions=("fwd", "bwd"), packed: bool = False, sbhd_batch: int = 0,
               numerics: str = "fp32", epilogue=None, weight_dtype=None, tuning=None,
               ape: bool = True) -> None:
    """Compile ahead of time (e.g. before CUDA-graph capture); "bwd" brings its "dape" and
    its large-pack variant. ``packed``: also the kernels of the packed layout
    (compress_thd_fused_packed, the Compressor module's THD path). ``sbhd_batch``: also
    those of SBHD inputs of that many sequences (compress_sbhd_fused, and with ``packed``
    compress_sbhd_fused_packed). ``numerics``: the ops' (the "eager" kernels are others).
    ``epilogue`` (an Epilogue): also the kernels with it inside (the ops' ``epilogue=``),
    both directions asked for, for a norm weight of ``weight_dtype`` (default ``dtype``).
    ``ape=False``: the kernels of calls with ``ape=None`` (no position bias)."""
    check_specialisation(dtype, ratio, coff, head_dim)
    check_flag("packed", packed)
    check_int("sbhd_batch", sbhd_batch, 0)
    check_pool_numerics(numerics)
    check_flag("ape", ape)
    if isinstance(directions, str) or not set(directions) <= {"fwd", "bwd"} or not directions:
        raise ValueError(f"directions: expected a sequence of 'fwd' and 'bwd', got {directions!r}")
    key = None
    if epilogue is not None:
        if not isinstance(epilogue, Epilogue):
            raise TypeError(f"epilogue: expected a csa_compressor.Epilogue, got {type(epilogue).__name__}")
        epilogue.check(head_dim)
        if weight_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"weight_dtype: expected bf16, fp16 or fp32, got {weight_dtype}")
        key = EpilogueKey.of(epilogue, weight_dtype or dtype)
    device = check_cuda_device(device)
    widths = (coff * head_dim, 2 * coff * head_dim) if packed else (coff * head_dim,)
    layouts = [(w, 0) for w in widths] + [(sbhd_batch * w, sbhd_batch) for w in widths
                                          if sbhd_batch]
    _compile.precompile(dtype, ratio, coff, head_dim, device, tuple(directions), tuple(layouts),
                        numerics, key, _tuning(tuning), ape)
