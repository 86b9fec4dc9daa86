"""The kernel-level pooling of one pack, planned once and run many times (every layer of a
step shares its pack): the offsets are checked on the host and copied to the device when
the plan is made, and the kernels, their launch sizes and the buffers' shapes are fixed
then, so a run checks its tensors against the plan (shape, dtype, device, contiguous,
aligned, disjoint) and launches. No offsets guard runs: the plan's own offsets are well
formed by construction."""

from __future__ import annotations

import torch

from .checks import (INT32_MAX, KERNEL_ALIGN_BYTES, check_cuda_device, check_disjoint,
                     check_flag, check_int, check_out, check_pool_numerics, check_specialisation,
                     halves, kernel_aligned)
from .kernels import plan as kplan
from .kernels.compile import compiled_for
from .kernels.hardware import sm_count
from .kernels.launch import backward_plan, on_device, sum_dape
from .kernels.tuning import Tuning, current
from .layout import compressed_cu_seqlens
from .pooling import pool
from .validation import Problem, check_token_offsets

__all__ = ["PoolPlan"]


def _host_offsets(cu_seqlens) -> torch.Tensor:
    """``cu_seqlens`` as a 1-D int64 CPU tensor (a device tensor: one host sync)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected int32 (or int64) offsets, got {cu_seqlens.dtype}")
        c = cu_seqlens.detach().to("cpu", torch.int64)
    elif isinstance(cu_seqlens, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in cu_seqlens):
        c = torch.tensor(cu_seqlens, dtype=torch.int64)
    else:
        raise TypeError("cu_seqlens: expected a 1-D int tensor or a list of ints, got "
                        f"{type(cu_seqlens).__name__}")
    if c.dim() != 1 or c.numel() < 2:
        raise ValueError(f"cu_seqlens: expected B+1 >= 2 offsets, got shape {tuple(c.shape)}")
    return c


class PoolPlan:
    """The fused pooling of one THD pack into caller buffers, its checks and plans done at
    construction. ``cu_seqlens``: the pack's offsets, on the host (a list or a CPU tensor;
    a CUDA tensor costs one host sync here). ``num_tokens``: kv's rows (default
    ``cu_seqlens[-1]``); ``total_comp``: the output's rows (default: the pack's).
    ``ape=False``: runs take ``ape=None`` (no position bias). ``numerics`` as the ops';
    ``tuning`` frozen here (default: the process's now). Runs go in stream order on any
    stream: forward and backward allocate only the backward's dape partials."""

    def __init__(self, cu_seqlens, *, ratio: int, coff: int, head_dim: int,
                 dtype: torch.dtype, num_tokens: int | None = None,
                 total_comp: int | None = None, device=None, ape: bool = True,
                 numerics: str = "fp32", tuning: Tuning | None = None):
        check_specialisation(dtype, ratio, coff, head_dim)
        check_flag("ape", ape)
        check_pool_numerics(numerics)
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning: expected None or a kernels.tuning.Tuning, got "
                            f"{type(tuning).__name__}")
        c = _host_offsets(cu_seqlens)
        T = int(c[-1]) if num_tokens is None else check_int("num_tokens", num_tokens, 0)
        check_token_offsets(c, T)
        cc = compressed_cu_seqlens(c, ratio)
        rows = int(cc[-1])
        N = rows if total_comp is None else check_int("total_comp", total_comp, rows)
        W = coff * head_dim
        if T * W > INT32_MAX or N * head_dim > INT32_MAX:
            raise ValueError(f"num_tokens, total_comp: T*coff*d = {T * W} and N*d = "
                             f"{N * head_dim} must fit int32 offsets (max {INT32_MAX})")
        dev = check_cuda_device(device)
        self.ratio, self.coff, self.head_dim, self.dtype, self.device = ratio, coff, head_dim, dtype, dev
        self.num_tokens, self.total_comp, self.has_ape, self.numerics = T, N, ape, numerics
        self.tuning = tuning or current()
        self._cu = c.to(torch.int32).to(dev)
        self._cuc = cc.to(dev)
        self._tokens, self._rows = torch.Size((T, W)), torch.Size((N, head_dim))
        self._ape = torch.Size((ratio, W))
        # no position bias: the kernels read zeros in the APE's place
        self._zeros = None if ape else torch.zeros(self._ape, dtype=torch.float32, device=dev)
        self._no_ape = torch.empty((0,), dtype=torch.float32, device=dev)  # Problem's stand-in
        self._packed = torch.Size((T, 2 * W))
        # where kvs' second half starts in each row, which the kernels' vector loads need
        # 16-byte aligned (pool_packed)
        self._half_bytes = W * dtype.itemsize
        self._fwd, self._bwd = {}, {}  # kernels and launch sizes, found at the first run

    def __repr__(self) -> str:
        return (f"PoolPlan(ratio={self.ratio}, coff={self.coff}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, num_tokens={self.num_tokens}, total_comp="
                f"{self.total_comp}, segments={self._cu.numel() - 1}, ape={self.has_ape}, "
                f"numerics={self.numerics!r}, device={self.device})")

    def _check(self, name: str, t, shape, dtype) -> None:
        # one line of attribute reads a tensor; check_out says which one failed
        if not (type(t) is torch.Tensor and t.shape == shape and t.dtype == dtype
                and t.device == self.device and t.is_contiguous()
                and not t.data_ptr() % KERNEL_ALIGN_BYTES):
            check_out(name, t, tuple(shape), dtype, self.device)

    def _fits(self, name: str, t, shape, dtype) -> None:
        # shape and dtype alone: all that a traced run's fake tensors can show
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
            check_out(name, t, tuple(shape), dtype, self.device)

    def _inputs(self, kv, score, ape) -> torch.Tensor:
        """The APE the kernels read, after checking the inputs."""
        self._check("kv", kv, self._tokens, self.dtype)
        self._check("score", score, self._tokens, self.dtype)
        return self._read_ape(ape)

    def _read_ape(self, ape) -> torch.Tensor:
        """``ape`` checked, or the plan's zeros where it has no APE."""
        self._ape_as_planned(ape)
        if self.has_ape:
            self._check("ape", ape, self._ape, torch.float32)
            return ape
        return self._zeros

    def _ape_as_planned(self, ape) -> None:
        if self.has_ape and ape is None:
            raise TypeError(f"ape: expected a {tuple(self._ape)} float32 tensor (the plan was "
                            "made with ape=True), got None")
        if not self.has_ape and ape is not None:
            raise ValueError("ape: expected None (the plan was made with ape=False), got "
                             f"{type(ape).__name__}")

    def forward(self, kv, score, ape, out) -> torch.Tensor:
        """Write the pooled rows into ``out`` ``(total_comp, head_dim)`` of kv's dtype;
        ``kv`` and ``score`` ``(num_tokens, coff*head_dim)``, ``ape`` ``(ratio,
        coff*head_dim)`` fp32 (None for a plan without one)."""
        a = self._inputs(kv, score, ape)
        self._check("out", out, self._rows, self.dtype)
        check_disjoint((("out", out),), (("kv", kv), ("score", score), ("ape", ape)))
        return self._launch_forward(kv, score, a, out)

    def backward(self, kv, score, ape, grad_out, grad_kv, grad_score, grad_ape):
        """Write every element of ``grad_kv`` and ``grad_score`` (the shape of kv; may start
        uninitialised) and ``grad_ape`` (fp32, the shape of ape; None for a plan without an
        APE), bitwise what pool_backward writes. ``grad_score`` may be float32 for bf16 /
        fp16 inputs (dscore before its rounding). Returns the three (grad_ape None without
        an APE)."""
        a = self._inputs(kv, score, ape)
        self._check("grad_out", grad_out, self._rows, self.dtype)
        self._check("grad_kv", grad_kv, self._tokens, self.dtype)
        # as pool_backward: an fp32 grad_score for narrower inputs takes dscore unrounded
        fp32_dscore = getattr(grad_score, "dtype", None) == torch.float32 \
            and self.dtype != torch.float32
        self._check("grad_score", grad_score, self._tokens,
                    torch.float32 if fp32_dscore else self.dtype)
        outs = (("grad_kv", grad_kv), ("grad_score", grad_score))
        if self.has_ape:
            self._check("grad_ape", grad_ape, self._ape, torch.float32)
            outs += (("grad_ape", grad_ape),)
        elif grad_ape is not None:
            raise ValueError("grad_ape: expected None (the plan was made with ape=False), got "
                             f"{type(grad_ape).__name__}")
        check_disjoint(outs, (("kv", kv), ("score", score), ("ape", ape), ("grad_out", grad_out)))
        self._launch_backward(kv, score, a, grad_out, grad_kv, grad_score, grad_ape,
                              fp32_dscore=fp32_dscore)
        return grad_kv, grad_score, grad_ape

    def pool(self, kv, score, ape) -> torch.Tensor:
        """The pooled rows ``(total_comp, head_dim)`` as compress_thd_fused gives them for
        this pack, differentiable in kv, score and ape, without its validation of the pack
        and without the offsets guard's launch."""
        if torch.compiler.is_compiling():
            return self._traced(kv, score, ape)
        a = self._inputs(kv, score, ape)
        return self._pooled((kv, score), a, ape, kv, score, 0, False)

    def pool_packed(self, kvs, ape, score_first: bool = False) -> torch.Tensor:
        """pool for kv and score as the column halves of one tensor ``kvs`` ``(num_tokens,
        2*coff*head_dim)`` (``[kv | score]``, or ``[score | kv]`` where ``score_first``), as
        compress_thd_fused_packed, differentiable in kvs and ape."""
        check_flag("score_first", score_first)
        if torch.compiler.is_compiling():
            return self._traced(None, None, ape, kvs, score_first)
        if self._half_bytes % KERNEL_ALIGN_BYTES:
            raise ValueError(f"kvs: the second half starts {self._half_bytes} bytes into each "
                             f"row; the fused kernels need a multiple of {KERNEL_ALIGN_BYTES}")
        self._check("kvs", kvs, self._packed, self.dtype)
        a = self._read_ape(ape)
        # the halves are the kernels' views; autograd differentiates kvs itself
        kv, score = halves(kvs.detach() if kvs.requires_grad else kvs, score_first)
        return self._pooled((kvs,), a, ape, kv, score, self._packed[1], score_first)

    def _traced(self, kv, score, ape, kvs=None, score_first=False) -> torch.Tensor:
        """Under torch.compile: the ops' custom ops, which trace (fake tensors) and check
        every argument again when they run. They would take any pack's sizes and dtype,
        and an absent APE as no position bias, so those are held to the plan first (fake
        tensors have no address to check)."""
        self._ape_as_planned(ape)
        if kvs is None:
            self._fits("kv", kv, self._tokens, self.dtype)
            self._fits("score", score, self._tokens, self.dtype)
        else:
            self._fits("kvs", kvs, self._packed, self.dtype)
        if self.has_ape:
            self._fits("ape", ape, self._ape, torch.float32)
        p = Problem(kv, score, self._no_ape if ape is None else ape, self._cu, self._cuc,
                    self.total_comp, self.ratio, self.coff, self.head_dim, kvs=kvs,
                    numerics=self.numerics, tuning=self.tuning, score_first=score_first)
        return pool(p)

    def _pooled(self, inputs, a, ape, kv, score, row_stride, score_first) -> torch.Tensor:
        if torch.is_grad_enabled() and (any(t.requires_grad for t in inputs)
                                        or (ape is not None and ape.requires_grad)):
            return _Planned.apply(self, (kv, score, a, row_stride, score_first), ape, *inputs)
        out = torch.empty(self._rows, dtype=self.dtype, device=self.device)
        return self._launch_forward(kv, score, a, out, row_stride)

    def _launch_forward(self, kv, score, a, out, row_stride: int = 0) -> torch.Tensor:
        if not self.total_comp:
            return out
        fn, rows = self._fwd.get(row_stride) or self._forward_kernel(row_stride)
        with on_device(self.device):
            fn(kv, score, a, self._cu, self._cuc, out, rows)
        return out

    def _forward_kernel(self, row_stride: int) -> tuple:
        """(launchable, rows a thread) of this plan's forward, compiled at the first run."""
        c = compiled_for(kplan.spec("fwd", self.dtype, self.ratio, self.coff, self.head_dim,
                                    self.tuning, row_stride=row_stride, numerics=self.numerics,
                                    ape=self.has_ape), self.device)
        rows = c.kernel.rows_per_thread(self.total_comp, sm_count(self.device.index),
                                        c.ctas_per_sm, self.tuning)
        got = self._fwd[row_stride] = (c.fn, rows)
        return got

    def _launch_backward(self, kv, score, a, grad_out, grad_kv, grad_score, grad_ape,
                         row_stride: int = 0, fp32_dscore: bool = False) -> None:
        if not self.total_comp or not self.num_tokens:
            for g in (grad_kv, grad_score, grad_ape):
                if g is not None:
                    g.zero_()
            return
        key = (row_stride, fp32_dscore)
        c, args, shape = self._bwd.get(key) or self._backward_kernel(key)
        with on_device(self.device):
            workspace = torch.empty(shape, dtype=torch.float32, device=self.device)
            c.fn(kv, score, a, self._cu, self._cuc, grad_out, grad_kv, grad_score, workspace,
                 *args)
            if self.has_ape:
                sum_dape(c, args[1], workspace, grad_ape, self.tuning)

    def _backward_kernel(self, key: tuple) -> tuple:
        """(compiled, launch sizes, dape partials' shape) of this plan's backward, compiled at
        the first run."""
        row_stride, fp32_dscore = key
        c, args, shape = backward_plan(self.device, self.dtype, self.ratio, self.coff,
                                       self.head_dim, self.total_comp, self.num_tokens,
                                       row_stride=row_stride, numerics=self.numerics,
                                       tuning=self.tuning, fp32_dscore=fp32_dscore,
                                       ape=self.has_ape)
        if not self.has_ape:  # the kernels write no partials: one row stands in
            shape = (1, shape[1])
        got = self._bwd[key] = (c, args, shape)
        return got


class _Planned(torch.autograd.Function):
    """A plan's differentiable pooling: its launches on the plan's offsets, the caller's
    tensors saved (version checks, saved-tensor hooks), the kernels' views derived again
    from them in the backward."""

    @staticmethod
    def forward(ctx, plan, how, ape, *inputs):
        kv, score, a, row_stride, score_first = how
        out = torch.empty(plan._rows, dtype=plan.dtype, device=plan.device)
        plan._launch_forward(kv, score, a, out, row_stride)
        ctx.save_for_backward(a, *inputs)
        ctx.plan, ctx.how = plan, (row_stride, score_first)
        return out

    @staticmethod
    def backward(ctx, grad):
        plan, (row_stride, score_first) = ctx.plan, ctx.how
        a, *inputs = ctx.saved_tensors
        if row_stride:
            kvs = inputs[0]
            grads = (torch.empty_like(kvs),)
            kv, score = halves(kvs, score_first)
            dkv, dscore = halves(grads[0], score_first)
        else:
            kv, score = inputs
            grads = dkv, dscore = torch.empty_like(kv), torch.empty_like(score)
        dape = torch.empty(plan._ape, dtype=torch.float32, device=plan.device) \
            if plan.has_ape else None
        plan._launch_backward(kv, score, a, kernel_aligned(grad), dkv, dscore, dape, row_stride)
        return (None, None, dape, *grads)
