"""``Compressor``: the whole Compressor block as an ``nn.Module`` (projections, gated
pooling, RMSNorm, rotary embedding, optional Hadamard rotation)."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import reference
from .checks import SUPPORTED_DTYPES, check_flag, check_int, check_ratio_coff, check_tensor, halves
from .dispatch import fused_or_reason, fused_packed_or_reason, fused_sbhd_or_reason
from .epilogue import (Epilogue, YaRN, eager_epilogue, megatron_epilogue, megatron_inv_freq,
                       rope_inv_freq, rope_positions, sbhd_positions)
from .epilogue_op import apply_epilogue
from .fused_epilogue import EpilogueInside, Finish
from .layout import compressed_capacity, compressed_cu_seqlens
from .module_v41 import CompressorV41, megatron_mapped

POOLING = ("auto", "fused", "reference")
NUMERICS = ("fp32", "megatron", "megatron_eager")
# "inside": the fused epilogue, inside the pooling kernels where epilogue_inside says;
# "after": its own kernels after the pooling's; "torch": the torch ops (the same bits)
EPILOGUE_FUSION = ("inside", "after", "torch")
# "fp64": theta ** (-2i / rope_dim) in fp64; "megatron": in fp32 as Megatron-LM's rotary
# module makes them (then its angles, and so its rows, bit for bit)
ROPE_FREQUENCIES = ("fp64", "megatron")


def _adjacent(a, b) -> bool:
    """Whether ``b`` starts where ``a`` ends in one storage, both plain 2-D row-major tensors
    of one width (not DTensors or other subclasses): ``[a; b]`` is then a view of that
    storage."""
    return (type(a.data) is torch.Tensor and type(b.data) is torch.Tensor
            and a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1] and a.dtype == b.dtype
            and a.device == b.device and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


class _JointLinear(torch.autograd.Function):
    """``linear(x, cat((wa, wb)))`` where ``wb`` follows ``wa`` in memory: the GEMMs read the
    two as one matrix in place (no concatenation copy). Its backward runs the products
    autograd runs through ``linear`` (``g @ w``; ``g.t() @ x`` for the weight, in that
    operand order), so the numbers and the gradients' layouts are the concatenation's."""

    @staticmethod
    def joint(wa, wb):
        """``[wa; wb]`` as one view of their storage."""
        return wa.as_strided((wa.shape[0] + wb.shape[0], wa.shape[1]), (wa.shape[1], 1),
                             wa.storage_offset())

    @staticmethod
    def forward(ctx, x, wa, wb):
        ctx.save_for_backward(x, wa, wb)
        return nn.functional.linear(x, _JointLinear.joint(wa, wb))

    @staticmethod
    def backward(ctx, g):
        x, wa, wb = ctx.saved_tensors
        w = _JointLinear.joint(wa, wb)
        g2 = g.reshape(-1, g.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g2.mm(w).view(x.shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        n = wa.shape[0]
        return dx, None if dw is None else dw[:n], None if dw is None else dw[n:]


def _owns_storage(t) -> bool:
    """Whether ``t`` is all of its storage (not a view into a larger buffer)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def joint_projection(x, wkv, wgate):
    """``[kv | score]`` of ``x``: one GEMM into ``(..., wkv.shape[0] + wgate.shape[0])``. Where
    ``wgate`` follows ``wkv`` in one buffer the GEMM reads them as one matrix in place;
    elsewhere, and under autocast or torch.compile, it takes their concatenation: the same
    numbers."""
    if not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type) \
            and _adjacent(wkv, wgate):
        return _JointLinear.apply(x, wkv, wgate)
    return nn.functional.linear(x, torch.cat((wkv, wgate)))


def joint_projection_as_stored(x, wkv, wgate):
    """``(kvs, score_first)``: joint_projection's ``[kv | score]``, or ``[score | kv]`` where
    ``wkv`` follows ``wgate`` in one buffer (Megatron's DDP parameter buffer lays a module's
    parameters out in reverse order), the GEMM then reading ``[wgate; wkv]`` in place (no
    copy a step, none kept for the backward). The input gradient's GEMM sums the same
    products in another order than the concatenation's."""
    if not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type) \
            and _adjacent(wgate, wkv) and not _adjacent(wkv, wgate):
        return _JointLinear.apply(x, wgate, wkv), True
    return joint_projection(x, wkv, wgate), False


class Compressor(nn.Module):
    """Projections ``wkv`` / ``wgate`` (hidden -> coff*head_dim), the gated pooling (fused
    where it can run, else the fp32 reference), RMSNorm over head_dim, rotary embedding on
    the last ``rope_dim`` channels (default: 64, or all of a smaller head_dim) and an
    optional Hadamard rotation. ``coff`` defaults to 2 at ratio 4, else 1.
    ``megatron_layout``: THD outputs shaped as Megatron-LM's Compressor returns them,
    ``(N, 1, head_dim)``, and ``(None, cu_seqlens_comp)`` when no row compresses;
    ``load_megatron_state_dict`` takes its parameters. ``numerics``: "fp32" (the pooling and
    the epilogue in fp32, one rounding each; the fused epilogue), "megatron": rounded
    where Megatron-LM's Compressor rounds around an fp32 pooling (what its fused path
    computes): two projection GEMMs whose input gradients add in the dtype, and the
    epilogue of megatron_epilogue (torch ops, Megatron's fp32 rotary angles), or
    "megatron_eager": "megatron" with the pooling rounded as Megatron's eager region
    rounds it (softmax weights and products in the dtype; the kernels' numerics="eager"),
    which is what Megatron's Compressor computes without fused kernels.
    ``epilogue_fusion`` (fp32 numerics): "inside" (the epilogue inside the pooling kernels
    where ``epilogue_inside``, an EpilogueInside, says, else after them), "after" (its own
    kernels after the pooling's), "torch" (the torch ops): the same bits each way.
    ``rope_frequencies``: "fp64" (``theta ** (-2i / rope_dim)`` in fp64) or "megatron" (in
    fp32, as Megatron-LM's rotary module makes them: with Megatron's parameters the module
    then computes what Megatron's installed Compressor computes, bit for bit)."""

    MEGATRON_KEYS = {"linear_wkv.weight": "wkv.weight", "linear_wgate.weight": "wgate.weight",
                     "ape": "ape", "norm.weight": "norm_weight"}

    @staticmethod
    def v41(hidden_size: int, head_dim: int, ratio: int, **kwargs):
        """DeepSeek-V4.1's compressor (Megatron-LM's CSA2Compressor): fp32 projections, no
        position bias, no overlap, no RoPE, the norm after rounding; ratio 1 a projection
        and the norm (module_v41.CompressorV41; ``norm_eps``, ``dtype``, ``device``,
        ``pooling``)."""
        return CompressorV41(hidden_size, head_dim, ratio, **kwargs)

    def load_megatron_state_dict(self, state_dict, strict: bool = True):
        """Load a Megatron-LM ``Compressor``'s ``state_dict`` (its keys mapped onto this
        module's; Transformer Engine's ``_extra_state`` entries are skipped)."""
        return self.load_state_dict(megatron_mapped(state_dict, self.MEGATRON_KEYS, strict,
                                                    "a Megatron Compressor"), strict=strict)

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, *, coff: int | None = None,
                 rope_dim: int | None = None, rope_theta: float = 160000.0,
                 rope_interleaved: bool = True, norm_eps: float = 1e-6, rotate: bool = False,
                 dtype=torch.bfloat16, device=None, pooling: str = "auto",
                 megatron_layout: bool = False, rope_yarn: YaRN | None = None,
                 numerics: str = "fp32", epilogue_fusion: str = "inside", epilogue_inside=None,
                 rope_frequencies: str = "fp64"):
        super().__init__()
        check_int("hidden_size", hidden_size, 1)
        check_int("head_dim", head_dim, 1)
        check_int("ratio", ratio, 1)
        coff = (2 if ratio == 4 else 1) if coff is None else coff
        check_ratio_coff(ratio, coff)
        if rope_dim is None:
            rope_dim = min(64, head_dim - head_dim % 2)
        check_int("rope_dim", rope_dim, 0)
        if rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"rope_dim: expected an even int in [0, head_dim={head_dim}], got {rope_dim}")
        for name, value in (("rope_theta", rope_theta), ("norm_eps", norm_eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        check_flag("rope_interleaved", rope_interleaved)
        check_flag("rotate", rotate)
        check_flag("megatron_layout", megatron_layout)
        if rope_yarn is not None and not isinstance(rope_yarn, YaRN):
            raise TypeError(f"rope_yarn: expected a csa_compressor.epilogue.YaRN, got {rope_yarn!r}")
        if rotate and head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: rotate=True needs a power of two, got {head_dim}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
        if pooling not in POOLING:
            raise ValueError(f"pooling: expected one of {POOLING}, got {pooling!r}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
        if epilogue_fusion not in EPILOGUE_FUSION:
            raise ValueError(f"epilogue_fusion: expected one of {EPILOGUE_FUSION}, got "
                             f"{epilogue_fusion!r}")
        self.epilogue_inside = EpilogueInside.of(epilogue_inside)
        if rope_frequencies not in ROPE_FREQUENCIES:
            raise ValueError(f"rope_frequencies: expected one of {ROPE_FREQUENCIES}, got "
                             f"{rope_frequencies!r}")
        self.rope_frequencies = rope_frequencies
        self.hidden_size, self.head_dim, self.ratio, self.coff = hidden_size, head_dim, ratio, coff
        self.rope_dim, self.rope_theta, self.rope_interleaved = rope_dim, rope_theta, rope_interleaved
        self.norm_eps, self.rotate, self.pooling = norm_eps, rotate, pooling
        self.megatron_layout, self.rope_yarn = megatron_layout, rope_yarn
        self.numerics = numerics
        self.epilogue = Epilogue(norm_eps, rope_dim, rope_theta, rope_interleaved, rope_yarn, rotate)
        self._inv_freq = {}  # device -> rotary frequencies (_rope_inv_freq)
        self.epilogue_fusion = epilogue_fusion
        width = coff * head_dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=dtype, device=device)
        self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=dtype, device=device)
        self.ape = nn.Parameter(0.02 * torch.randn(ratio, width, dtype=torch.float32, device=device))
        self.norm_weight = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device))
        self._join_weights()
        # THD inputs take one projection GEMM into [kv | score] (one GEMM backward, no add of
        # two input gradients) where the kernels can read its halves in place.
        self.one_projection = numerics == "fp32" and \
            (width * torch.tensor([], dtype=dtype).element_size()) % 16 == 0

    @property
    def pool_numerics(self) -> str:
        """The pooling's rounding (the ops' ``numerics``) under the module's numerics."""
        return "eager" if self.numerics == "megatron_eager" else "fp32"

    def project(self, x):
        """``[kv | score]`` of ``x``: one GEMM into ``(..., 2*coff*head_dim)``
        (joint_projection). The two weights live in one buffer (``wgate`` right after
        ``wkv``), so the GEMM reads them in place unless a caller rebound one."""
        return joint_projection(x, self.wkv.weight, self.wgate.weight)

    def _project(self, x):
        """``(kvs, score_first)``: project()'s one GEMM reading the two weights in place in
        whichever order they lie in one buffer (joint_projection_as_stored): ``[score | kv]``
        where a wrapper's parameter buffer holds ``wgate`` right before ``wkv``, as
        Megatron's DistributedDataParallel lays them out."""
        return joint_projection_as_stored(x, self.wkv.weight, self.wgate.weight)

    def _join_weights(self):
        """Put ``wkv`` and ``wgate``'s weights into one buffer (the same Parameter
        objects, their data moved): project() then needs no copy of them a step. Weights
        that are views into a larger buffer (a DDP or FSDP parameter buffer) stay where
        they are: moving them would cut them off from it."""
        wkv, wgate = self.wkv.weight, self.wgate.weight
        if type(wkv.data) is not torch.Tensor or type(wgate.data) is not torch.Tensor \
                or _adjacent(wkv, wgate) or wkv.dtype != wgate.dtype or wkv.device != wgate.device \
                or wkv.shape != wgate.shape or not (_owns_storage(wkv) and _owns_storage(wgate)):
            return
        with torch.no_grad():
            joint = torch.cat((wkv.detach(), wgate.detach()))
        wkv.data, wgate.data = joint[: wkv.shape[0]], joint[wkv.shape[0]:]

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() give every parameter its own storage: join them again
        out = super()._apply(fn, *args, **kwargs)
        self._join_weights()
        return out

    def pool_packed(self, kvs, cu, cuc, total_comp, score_first: bool = False, pos=None):
        """pool() of project()'s output (``[score | kv]`` where ``score_first``), its halves
        read in place."""
        kv, score = halves(kvs, score_first)
        return self.pool(kv, score, cu, cuc, total_comp, packed=kvs, score_first=score_first,
                         pos=pos)

    def pool(self, kv, score, cu, cuc, total_comp, packed=None, score_first=False, pos=None):
        """The pooled rows: fused where it can run (on ``packed``, kv and score's one tensor,
        where given), else the fp32 reference. ``pos`` given: the epilogue's output at
        those positions (in the pooling kernels where the fused path runs)."""
        args = (kv, score, self.ape, cu, cuc, total_comp)
        kw = dict(ratio=self.ratio, coff=self.coff)
        num = self.pool_numerics
        fin = self._in_kernel_finish(pos)
        return self._pooled(
            lambda: (fused_or_reason(*args, **kw, numerics=num, finish=fin) if packed is None
                     else fused_packed_or_reason(packed, *args[2:], **kw,
                                                 score_first=score_first, numerics=num,
                                                 finish=fin)),
            lambda: reference.compress_thd(*args, **kw, mode=reference.MODE_OF_NUMERICS[num]),
            fin is not None, pos)

    def pool_sbhd(self, x, pos=None):
        """The pooled ``(S // ratio, B, head_dim)`` rows of ``x`` ``(S, B, hidden)``: the
        projections' output read in place by the fused kernels (one GEMM where
        ``one_projection``), else the fp32 reference. ``pos``: as pool()'s."""
        kw = dict(ratio=self.ratio, coff=self.coff)
        fin = self._in_kernel_finish(pos)
        if self.one_projection:
            kvs, score_first = self._project(x)
            kv, score = halves(kvs, score_first)
            fused = lambda: fused_sbhd_or_reason(kvs, None, self.ape, packed=True,  # noqa: E731
                                                 score_first=score_first, **kw, finish=fin)
        else:
            kv, score = self.wkv(x), self.wgate(x)
            fused = lambda: fused_sbhd_or_reason(kv, score, self.ape, **kw,  # noqa: E731
                                                 numerics=self.pool_numerics, finish=fin)
        mode = reference.MODE_OF_NUMERICS[self.pool_numerics]
        return self._pooled(fused, lambda: reference.compress_sbhd(kv, score, self.ape, **kw,
                                                                   mode=mode),
                            fin is not None, pos)

    def _in_kernel_finish(self, pos):
        """The epilogue the fused pooling takes inside its kernels (fp32 numerics with the
        fused epilogue; fused_epilogue.Finish), or None."""
        if pos is None or self.numerics != "fp32" or self.epilogue_fusion != "inside":
            return None
        return Finish(self.epilogue, self.norm_weight, pos,
                      inv_freq=self._rope_inv_freq(pos.device), inside=self.epilogue_inside)

    def _pooled(self, fused, fallback, finished=False, pos=None):
        """``fused()``'s rows where the fused path runs (``pooling`` not "reference"), else
        ``fallback()``'s; ``pooling="fused"`` raises with the reason instead. With ``pos``
        the epilogue's output (``finished``: the fused path's rows are that already)."""
        if self.pooling != "reference":
            out, reason = fused()
            if reason is None:
                if pos is None or finished:
                    return out
                return self._finish(out.reshape(-1, out.shape[-1]), pos).view(out.shape)
            if self.pooling == "fused":
                raise RuntimeError(f"Compressor(pooling='fused'): {reason}")
        out = fallback()
        if pos is None:
            return out
        return self._finish(out.reshape(-1, out.shape[-1]), pos).view(out.shape)

    def _finish(self, pooled, pos):
        if self.numerics != "fp32":
            return megatron_epilogue(pooled, self.norm_weight, pos, self.epilogue)
        if self.epilogue_fusion == "torch":
            return eager_epilogue(pooled, self.norm_weight, pos, self.epilogue)
        return apply_epilogue(pooled, self.norm_weight, pos, self.epilogue,
                              inv_freq=self._rope_inv_freq(pooled.device))

    def _rope_inv_freq(self, device):
        """The rotary frequencies, made once a device (a few kernels a step otherwise); not a
        buffer, which ``.to(dtype)`` would round. Made afresh while a CUDA graph captures or
        torch.compile traces (no tensor kept from inside either)."""
        if not self.rope_dim:
            return None
        megatron = self.rope_frequencies == "megatron"
        if torch.compiler.is_compiling():  # the epilogue's op makes fp64 ones, as eager does
            return self._make_inv_freq(device) if megatron else None
        freq = self._inv_freq.get(device)
        if freq is None:
            freq = self._make_inv_freq(device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._inv_freq[device] = freq
        return freq

    def _check_input(self, x, cu_seqlens, max_seqlen, total_comp):
        """Errors naming the argument before torch's own (a GEMM's shapes, autocast's
        device); returns ``max_seqlen`` as an int (one read where it is a tensor)."""
        check_tensor("x", x)
        w = self.wkv.weight
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"x: expected a CPU or CUDA tensor, got one on {x.device}")
        if x.device != w.device:
            raise ValueError(f"x: on {x.device}, the module's parameters on {w.device} "
                             "(move one: module.to(x.device))")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x: expected the module's dtype {w.dtype}, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected hidden size {self.hidden_size} in the last dim, got "
                             f"shape {tuple(x.shape)}")
        if cu_seqlens is not None:
            check_tensor("cu_seqlens", cu_seqlens)
        if max_seqlen is not None:
            max_seqlen = check_int("max_seqlen", int(max_seqlen) if isinstance(
                max_seqlen, torch.Tensor) else max_seqlen, 0)
        if total_comp is not None:
            check_int("total_comp", total_comp, 0)
        return max_seqlen

    def _make_inv_freq(self, device):
        if self.rope_frequencies == "megatron":
            return megatron_inv_freq(self.rope_dim, self.rope_theta, self.rope_yarn,
                                     device).double()
        return rope_inv_freq(self.rope_dim, self.rope_theta, self.rope_yarn, device=device)

    def forward(self, x, cu_seqlens=None, max_seqlen=None, total_comp=None):
        """THD (``cu_seqlens`` given): ``x`` (T, hidden) or (T, 1, hidden) ->
        ``(compressed (N, head_dim), cu_seqlens_comp)``. ``total_comp`` defaults to the static
        capacity from ``max_seqlen`` (no sync) or else the true count (syncs).
        SBHD: ``x`` (S, B, hidden) -> (S // ratio, B, head_dim), or None where S < ratio
        (no block to compress, as Megatron-LM's Compressor returns)."""
        max_seqlen = self._check_input(x, cu_seqlens, max_seqlen, total_comp)
        if cu_seqlens is None:
            if x.dim() != 3:
                raise ValueError(f"x: expected (S, B, hidden) without cu_seqlens, got {tuple(x.shape)}")
            S, B, _ = x.shape
            if S < self.ratio:
                return None
            pos = sbhd_positions(S // self.ratio, B, self.ratio, device=x.device)
            return self.pool_sbhd(x, pos)  # (n, B, head_dim)
        if x.dim() == 3:
            if x.shape[1] != 1:
                raise ValueError(f"x: a 3-D THD input must be (T, 1, hidden), got {tuple(x.shape)}")
            x = x.squeeze(1)
        if x.dim() != 2:
            raise ValueError(f"x: expected (T, hidden) or (T, 1, hidden), got {tuple(x.shape)}")
        cuc = compressed_cu_seqlens(cu_seqlens, self.ratio)
        if total_comp is None:
            if max_seqlen is not None:
                total_comp = compressed_capacity(x.shape[0], cu_seqlens.numel() - 1, max_seqlen,
                                                 self.ratio)
            else:
                total_comp = int(cuc[-1])
        if total_comp == 0 and self.megatron_layout:
            return None, cuc
        pos = rope_positions(cuc, total_comp, self.ratio, max_seqlen)
        if self.one_projection:
            kvs, score_first = self._project(x)
            out = self.pool_packed(kvs, cu_seqlens, cuc, total_comp, score_first, pos)
        else:
            kv, score = self.wkv(x), self.wgate(x)
            out = self.pool(kv.contiguous(), score.contiguous(), cu_seqlens, cuc, total_comp,
                            pos=pos)
        return (out.unsqueeze(1) if self.megatron_layout else out), cuc
