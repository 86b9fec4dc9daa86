"""Input validation shared by every public entry (references, fused op, kernel API, dispatch).

Each error names the argument, the value seen and what was expected. By default nothing
here reads tensor contents, so validation never syncs the host with the device; the
offsets' contents are read where that costs no device sync (offsets on the CPU, eager
calls), and on the GPU only on request (``check_offsets=True``, or
``CSA_COMPRESSOR_CHECK_OFFSETS=1`` for every call), at the cost of one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import (INT32_MAX, KERNEL_ALIGN_BYTES, OFFSET_DTYPES, SUPPORTED_DTYPES, check_flag,
                     check_int, check_ratio_coff, check_tensor, env_flag, halves, log as _log)
from .layout import compressed_cu_seqlens

CHECK_OFFSETS_ENV = "CSA_COMPRESSOR_CHECK_OFFSETS"


@dataclass(slots=True)
class Problem:
    """A validated call: 2-D views of the inputs and the sizes that shape the work.
    (Slots, not frozen: a frozen dataclass took 0.9 µs to build, every call.)"""

    kv: torch.Tensor  # (T, coff*d)
    score: torch.Tensor  # (T, coff*d)
    ape: torch.Tensor  # (ratio, coff*d) fp32
    cu_seqlens: torch.Tensor  # (B+1,) int32
    cu_seqlens_comp: torch.Tensor  # (B+1,) int32
    total_comp: int
    ratio: int
    coff: int
    head_dim: int
    # kv and score as the column halves of one (T, 2*coff*d) tensor ``kvs`` (validate_packed):
    # their rows are row_stride = 2*coff*d apart; 0 and None otherwise.
    row_stride: int = 0
    kvs: torch.Tensor | None = None
    # SBHD (validate_sbhd): B sequences of S tokens interleaved token by token; kv and score
    # are sequence 0's (S, coff*d) views, the pack one segment of S tokens and S // ratio
    # rows, and ``full`` the caller's (S, B, coff*d) kv and score (None where ``kvs``, the
    # (S, B, 2*coff*d) packed tensor, holds both). batch 0: a THD pack.
    batch: int = 0
    full: tuple | None = None
    # ``kvs`` holds ``[score | kv]`` (one GEMM on weights stored gate first, as Megatron's
    # DDP parameter buffer lays them out) rather than ``[kv | score]``
    score_first: bool = False
    # "eager": the kernels round as Megatron-LM's eager region does (plan.NUMERICS)
    numerics: str = "fp32"
    # the kernels' tuning (kernels.tuning.Tuning); None: the process's (tuning.current())
    tuning: object = None
    # offsets this package built from lengths it checked on the host (streaming's packs):
    # the device-side offsets check is skipped (kernels.launch.ape_read)
    offsets_built: bool = False
    # the APE as the kernels read it (kernels.launch.ape_read), kept once made: a backward
    # of the same problem reuses its forward's, one offsets-guard launch a step
    read_ape: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[0]

    @property
    def has_ape(self) -> bool:
        """False for no position bias (``ape=None``): ``ape`` is then an empty tensor."""
        return self.ape.numel() != 0

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


def _as_2d(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 3:
        if t.shape[1] != 1:
            raise ValueError(f"{name}: a 3-D input must be (T, 1, coff*d), got shape {tuple(t.shape)}")
        return t.view(t.shape[0], t.shape[2]) if t.is_contiguous() else t[:, 0, :]
    if t.dim() != 2:
        raise ValueError(f"{name}: expected shape (T, coff*d) or (T, 1, coff*d), got {tuple(t.shape)}")
    return t


def _check_offsets(name: str, t) -> torch.Tensor:
    check_tensor(name, t)
    if t.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{name}: expected int32 (or int64) offsets, got {t.dtype}")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"{name}: expected a 1-D tensor of B+1 >= 2 offsets, got shape {tuple(t.shape)}")
    return t


def offsets_check_requested(check_offsets) -> bool:
    return check_flag("check_offsets", check_offsets) or env_flag(CHECK_OFFSETS_ENV, False)


_skipped_warned = []


def check_token_offsets(c, num_tokens: int) -> None:
    """``cu_seqlens``'s rules on its values ``c`` (a 1-D int64 CPU tensor, or a list of
    ints: a few Python compares where torch ops cost microseconds each): it starts at 0,
    never decreases and ends within the ``num_tokens`` tokens of kv."""
    if c[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(c[0])}")
    if isinstance(c, list):
        s = next((k for k in range(len(c) - 1) if c[k + 1] < c[k]), None)
    else:
        step = c[1:] - c[:-1]
        s = int(torch.nonzero(step < 0)[0]) if (step < 0).any() else None
    if s is not None:
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{s}] = "
                         f"{int(c[s])} > cu_seqlens[{s + 1}] = {int(c[s + 1])}")
    if c[-1] > num_tokens:
        raise ValueError(f"cu_seqlens: the last offset {int(c[-1])} is past the {num_tokens} "
                         "tokens of kv")


def check_offset_contents(p: "Problem") -> None:
    """Read the offsets (one host sync) and raise a ValueError naming the argument when they
    break the layout's rules: ``cu_seqlens`` starts at 0, never decreases, ends within the
    token count; ``cu_seqlens_comp`` is ``compressed_cu_seqlens(cu_seqlens, ratio)``;
    ``total_comp`` holds every row. Skipped (warned once) where a sync is impossible: inside
    torch.compile tracing and CUDA-graph capture."""
    cu, cuc = p.cu_seqlens, p.cu_seqlens_comp
    capturing = cu.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if torch.compiler.is_compiling() or capturing:
        if not _skipped_warned:
            _skipped_warned.append(True)
            _log.warning("csa_compressor: offsets not checked inside torch.compile or CUDA-graph "
                         "capture (the check needs a host sync); check an eager call instead")
        return
    c = cu.to(torch.int64).cpu()
    cc = cuc.to(torch.int64).cpu()
    check_token_offsets(c, p.num_tokens)
    want = compressed_cu_seqlens(c, p.ratio).to(torch.int64)
    if not torch.equal(cc, want):
        s = int(torch.nonzero(cc != want)[0])
        raise ValueError(
            f"cu_seqlens_comp: expected compressed_cu_seqlens(cu_seqlens, ratio={p.ratio}), "
            f"which has {int(want[s])} at index {s}, got {int(cc[s])} (built for another ratio, "
            "or swapped with cu_seqlens?)")
    if p.total_comp < int(want[-1]):
        raise ValueError(f"total_comp: the pack has {int(want[-1])} rows, got a capacity of "
                         f"{p.total_comp} (an understated max_seqlen?)")


def validate(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
             for_kernel: bool = False, check_offsets: bool = False,
             contents: bool = True, _packed=None, _row_stride: int = 0) -> Problem:
    """Check every argument of a THD call and return 2-D views and sizes.

    ``for_kernel`` adds what the fused kernels need beyond the math: a CUDA device,
    contiguous storage, 16-byte aligned data pointers and int32-addressable sizes.
    ``cu_seqlens_comp=None`` derives it from ``cu_seqlens`` on the device (no sync).
    ``check_offsets`` (or CSA_COMPRESSOR_CHECK_OFFSETS=1) also reads the offsets'
    contents: check_offset_contents. ``contents=False`` never reads them (the dispatch's
    capability check, which leaves them to the call it dispatches to).
    """
    check_ratio_coff(ratio, coff)
    check_int("total_comp", total_comp, 0)
    check_contents = contents and offsets_check_requested(check_offsets)  # one env read a call
    if cu_seqlens_comp is None:
        cu_seqlens_comp = compressed_cu_seqlens(_check_offsets("cu_seqlens", cu_seqlens), ratio)
    kv = _as_2d("kv", check_tensor("kv", kv))
    score = _as_2d("score", check_tensor("score", score))
    if ape is not None:
        check_tensor("ape", ape)
    if kv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kv: expected dtype bfloat16, float16 or float32, got {kv.dtype}")
    if score.dtype != kv.dtype:
        raise TypeError(f"score: expected the dtype of kv ({kv.dtype}), got {score.dtype}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected the shape of kv {tuple(kv.shape)}, got {tuple(score.shape)}")
    width = kv.shape[1]
    if width == 0 or width % coff:
        raise ValueError(f"kv: last dimension must be a positive multiple of coff={coff}, got {width}")
    if ape is None or (ape.dim() == 1 and ape.numel() == 0 and ape.dtype == torch.float32):
        # no position bias (DeepSeek-V4.1): an empty stand-in (Problem.has_ape), which the
        # custom ops carry as a tensor; the kernels read no APE and sum no dape
        ape = torch.empty((0,), dtype=torch.float32, device=kv.device)
    elif ape.dtype != torch.float32:
        raise TypeError(f"ape: expected float32, got {ape.dtype}")
    elif tuple(ape.shape) != (ratio, width):
        raise ValueError(f"ape: expected shape (ratio, coff*d) = ({ratio}, {width}), got {tuple(ape.shape)}")
    cu = _check_offsets("cu_seqlens", cu_seqlens)
    cuc = _check_offsets("cu_seqlens_comp", cu_seqlens_comp)
    if cuc.numel() != cu.numel():
        raise ValueError(
            f"cu_seqlens_comp: expected the length of cu_seqlens ({cu.numel()}), got {cuc.numel()}"
        )
    dev = kv.device
    if score.device != dev or ape.device != dev or cu.device != dev or cuc.device != dev:
        raise ValueError(
            "kv, score, ape, cu_seqlens, cu_seqlens_comp: expected one device, got "
            + ", ".join(f"{n}={t.device}" for n, t in
                        (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu),
                         ("cu_seqlens_comp", cuc)))
        )
    head_dim = width // coff
    row_stride = _row_stride or (0 if _packed is None else _packed.shape[1])
    if kv.shape[0] * (row_stride or width) > INT32_MAX:
        raise ValueError(f"kv: T*coff*d = {kv.shape[0] * (row_stride or width)} overflows int32 "
                         f"offsets (max {INT32_MAX})")
    if total_comp * head_dim > INT32_MAX:
        raise ValueError(f"total_comp: N*d = {total_comp * head_dim} overflows int32 offsets (max {INT32_MAX})")
    if for_kernel:
        if dev.type != "cuda":
            raise ValueError(f"kv: the fused kernels need CUDA tensors, got device {dev}")
        # Fake tensors (torch.compile tracing) have no storage; the op checks again at run time.
        real = not torch.compiler.is_compiling()
        for name, t in (("kv", kv), ("score", score), ("ape", ape)):
            # kvs' halves and SBHD sequences are strided views; their callers checked the
            # tensors they are views of
            if not t.is_contiguous() and not (row_stride and name != "ape"):
                raise ValueError(f"{name}: expected contiguous storage, got strides {t.stride()}")
            if real and t.data_ptr() % KERNEL_ALIGN_BYTES:
                raise ValueError(
                    f"{name}: expected a {KERNEL_ALIGN_BYTES}-byte aligned data pointer, "
                    f"got address {t.data_ptr():#x}"
                )
        for name, t in (("cu_seqlens", cu), ("cu_seqlens_comp", cuc)):
            if t.dtype == torch.int32 and not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous storage, got strides {t.stride()}")
    # Conversions only when needed: even a no-op .to().contiguous() costs ~3 µs of host time.
    if cu.dtype != torch.int32 or not cu.is_contiguous():
        cu = cu.to(torch.int32).contiguous()
    if cuc.dtype != torch.int32 or not cuc.is_contiguous():
        cuc = cuc.to(torch.int32).contiguous()
    p = Problem(kv, score, ape, cu, cuc, total_comp, ratio, coff, head_dim, row_stride, _packed)
    # offsets on the CPU cost no device sync to read: checked on every eager call
    if check_contents or (contents and cu.device.type == "cpu" and cuc.device.type == "cpu"
                          and not torch.compiler.is_compiling()):
        check_offset_contents(p)
    return p


def _untracked(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def validate_packed(kvs, ape, cu_seqlens, cu_seqlens_comp, total_comp, *, ratio, coff,
                    for_kernel: bool = False, check_offsets: bool = False,
                    contents: bool = True, score_first: bool = False) -> Problem:
    """validate for ``kv`` and ``score`` given as the column halves of one tensor ``kvs``
    ``(T, 2*coff*d)`` (or ``(T, 1, 2*coff*d)``): ``[kv | score]``, as one projection GEMM
    writes them (``[score | kv]`` where ``score_first``). For the kernels, ``kvs``
    contiguous and each half's rows 16-byte aligned."""
    kvs = _as_2d("kvs", check_tensor("kvs", kvs))
    check_ratio_coff(ratio, coff)
    check_flag("score_first", score_first)
    width2 = kvs.shape[1]
    if width2 == 0 or width2 % (2 * coff):
        raise ValueError(f"kvs: last dimension must be 2*coff*d (the kv and score columns), a "
                         f"positive multiple of {2 * coff}, got {width2}")
    w = width2 // 2
    if for_kernel:
        if not kvs.is_contiguous():
            raise ValueError(f"kvs: expected contiguous storage, got strides {kvs.stride()}")
        if (w * kvs.element_size()) % KERNEL_ALIGN_BYTES:
            raise ValueError(f"kvs: the second half starts {w * kvs.element_size()} bytes into "
                             f"each row; the fused kernels need a multiple of {KERNEL_ALIGN_BYTES} "
                             "(coff*d*element size)")
    # the halves are the kernels' views, never differentiated (the ops differentiate kvs):
    # slicing a tensor that requires grad records two autograd views, ~10 µs of host time
    p = validate(*halves(_untracked(kvs), score_first), ape, cu_seqlens, cu_seqlens_comp,
                 total_comp, ratio=ratio, coff=coff, for_kernel=for_kernel,
                 check_offsets=check_offsets, contents=contents, _packed=kvs)
    p.score_first = score_first
    return p


_SBHD_OFFSETS: dict = {}


def sbhd_offsets(S: int, n: int, device: torch.device):
    """(cu_seqlens, cu_seqlens_comp) of one segment of ``S`` tokens and ``n`` rows on
    ``device``, made once (device-side arithmetic: no copy from the host, so a first call
    inside CUDA-graph capture makes them too)."""
    key = (S, n, device)
    hit = _SBHD_OFFSETS.get(key)
    if hit is None:
        if len(_SBHD_OFFSETS) > 1024:
            _SBHD_OFFSETS.clear()
        steps = torch.arange(2, dtype=torch.int32, device=device)
        hit = _SBHD_OFFSETS[key] = (steps * S, steps * n)
    return hit


def _as_sbhd(name: str, t) -> torch.Tensor:
    check_tensor(name, t)
    if t.dim() != 3:
        raise ValueError(f"{name}: expected shape (S, B, width), got {tuple(t.shape)}")
    return t


def sbhd_rows_aligned(width: int, coff: int, element_size: int) -> bool:
    """Whether the SBHD kernels can read rows of ``width = coff*d`` elements in place: each
    sequence's token and output rows start 16 bytes apart."""
    return (width * element_size) % KERNEL_ALIGN_BYTES == 0 \
        and (width // coff * element_size) % KERNEL_ALIGN_BYTES == 0


def validate_sbhd(kv, score, ape, *, ratio, coff, for_kernel: bool = False,
                  packed: bool = False, score_first: bool = False) -> Problem:
    """Check an SBHD call, ``kv`` and ``score`` ``(S, B, coff*d)`` (``packed``: ``kv`` is
    ``kvs`` ``(S, B, 2*coff*d)``, ``[kv | score]`` in one tensor, or ``[score | kv]`` where
    ``score_first``, and ``score`` is None),
    and return the Problem the kernels run: sequence 0's views, one segment of S tokens.
    For the kernels, the caller's tensors contiguous and every sequence's rows 16-byte
    aligned: ``width * element size`` and ``d * element size`` multiples of 16."""
    check_ratio_coff(ratio, coff)
    if packed:
        kvs = _as_sbhd("kvs", kv)
        check_flag("score_first", score_first)
        width2 = kvs.shape[2]
        if width2 == 0 or width2 % (2 * coff):
            raise ValueError(f"kvs: last dimension must be 2*coff*d (the kv and score columns), "
                             f"a positive multiple of {2 * coff}, got {width2}")
        (kv, score), full, stride = halves(_untracked(kvs), score_first), None, width2
    else:
        kv, score, kvs = _as_sbhd("kv", kv), _as_sbhd("score", score), None
        if score.shape != kv.shape:
            raise ValueError(f"score: expected the shape of kv {tuple(kv.shape)}, got "
                             f"{tuple(score.shape)}")
        full, stride = (kv, score), kv.shape[2]
    S, B, width = kv.shape
    if B == 0:
        raise ValueError(f"{'kvs' if packed else 'kv'}: expected B >= 1 sequences, got shape "
                         f"{tuple((kvs if packed else kv).shape)}")
    if for_kernel:
        eb = kv.element_size()
        tensors = (("kvs", kvs),) if packed else (("kv", kv), ("score", score))
        for name, t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous storage, got strides {t.stride()}")
        if not sbhd_rows_aligned(width, coff, eb):
            raise ValueError(f"kv: the fused SBHD kernels need coff*d*element size and d*element size "
                             f"multiples of {KERNEL_ALIGN_BYTES} bytes (each sequence's rows "
                             f"aligned), got coff*d = {width} of {eb}-byte elements")
        if S * B * stride > INT32_MAX:
            raise ValueError(f"kv: S*B*width = {S * B * stride} overflows int32 offsets "
                             f"(max {INT32_MAX})")
    n = S // ratio  # S < ratio: no rows (Megatron's Compressor returns None there)
    cu, cuc = sbhd_offsets(S, n, kv.device)
    p = validate(_untracked(kv)[:, 0], _untracked(score)[:, 0], ape, cu, cuc, n, ratio=ratio,
                 coff=coff, for_kernel=for_kernel, contents=False, _packed=kvs,
                 _row_stride=B * stride)
    p.batch, p.full, p.score_first = B, full, bool(packed and score_first)
    return p


