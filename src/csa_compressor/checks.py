"""Argument checks beneath every layer (kernels included): each error names the argument,
the value seen and what was expected. Nothing here reads tensor contents."""

from __future__ import annotations

import logging
import os

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OFFSET_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
# The kernels load 16-byte vectors; pointers must allow it (the allocator gives 256 B).
KERNEL_ALIGN_BYTES = 16


POOL_NUMERICS = ("fp32", "eager")


def check_pool_numerics(numerics) -> str:
    """The pooling's ``numerics``: "fp32" (the fp32 region) or "eager" (rounded as
    Megatron-LM's eager region rounds)."""
    if numerics not in POOL_NUMERICS:
        raise ValueError(f"numerics: expected one of {POOL_NUMERICS}, got {numerics!r}")
    return numerics


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected an int {rng}, got {value}")
    return value


def check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_ratio_coff(ratio, coff) -> None:
    check_int("ratio", ratio, 1)
    if isinstance(coff, bool) or not isinstance(coff, int) or coff not in (1, 2):
        raise ValueError(f"coff: expected 1 or 2, got {coff!r}")


def check_specialisation(dtype, ratio, coff, head_dim) -> None:
    """The arguments that select a compiled kernel (precompile, backward_workspace_shape)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    check_ratio_coff(ratio, coff)
    check_int("head_dim", head_dim, 1)


def check_cuda_device(device) -> torch.device:
    """``device`` (None: the current one) as a CUDA torch.device that exists here."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("device: no CUDA GPU is available; the fused kernels need one "
                               "(compute capability 9.0 or newer)")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a CUDA device, got {device!r}") from exc
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device: {dev} asked for, but no CUDA GPU is available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device: {dev} does not exist ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", index)


log = logging.getLogger("csa_compressor")
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment switch; values other than the usual spellings are an error,
    so a typo never leaves a switch in an unintended state."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}: expected one of {', '.join(repr(v) for v in _ON + _OFF[1:])} "
                     f"(or unset), got {raw!r}")


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return value


def kernel_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels' vector loads read it: contiguous at a KERNEL_ALIGN_BYTES-aligned
    address (a copy where it is not: a view into a flat buffer, a row slice)."""
    t = t.contiguous()
    return t if t.data_ptr() % KERNEL_ALIGN_BYTES == 0 else t.clone()


def halves(kvs: torch.Tensor, score_first: bool = False) -> tuple:
    """``(kv, score)``: the column halves of ``kvs``, ``[kv | score]`` or, where
    ``score_first``, ``[score | kv]``."""
    w = kvs.shape[-1] // 2
    a, b = kvs[..., :w], kvs[..., w:]
    return (b, a) if score_first else (a, b)


def check_out(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller-provided output buffer of the kernel-level API."""
    check_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected contiguous storage, got strides {t.stride()}")
    if t.data_ptr() % KERNEL_ALIGN_BYTES:
        raise ValueError(f"{name}: expected a {KERNEL_ALIGN_BYTES}-byte aligned data pointer, got {t.data_ptr():#x}")
    return t


def _byte_ranges(pairs) -> list:
    """``(first byte, past the last, name)`` of each non-empty ``(name, tensor)``."""
    out = []
    for name, t in pairs:
        if t is not None and t.nbytes:
            lo = t.data_ptr()
            out.append((lo, lo + t.nbytes, name))
    return out


def check_disjoint(outputs: tuple, inputs: tuple) -> None:
    """The kernel API's output buffers (``(name, contiguous tensor)`` pairs, as check_out
    leaves them) share no byte with one another or with an input (``(name, tensor)``, each
    contiguous): a kernel reading what another CTA writes gives a silently wrong result.
    Empty tensors and None take no part. One sorted walk over the byte ranges; only where
    two ranges meet (inputs may share memory) is each output compared with the rest."""
    outs = _byte_ranges(outputs)
    ranges = outs + _byte_ranges(inputs)
    end = 0
    for lo, hi, _ in sorted(ranges):
        if lo < end:
            break
        end = hi
    else:
        return
    for i, (lo, hi, name) in enumerate(outs):
        for lo2, hi2, other in ranges[i + 1:]:
            if lo < hi2 and lo2 < hi:
                raise ValueError(f"{name}: shares memory with {other} (the kernels would read "
                                 f"what they write); expected a buffer of its own")


def poison_if_malformed(t: torch.Tensor, cu, cuc, num_tokens: int, total_comp: int, ratio: int):
    """``t``, or NaN where the offsets break the pack's rules (those of
    validation.check_offset_contents), in torch ops on the offsets' device: no host sync,
    differentiable in ``t`` (``t + 0`` where well formed: the same values). kernels.offsets.OffsetsGuard is the one-launch version."""
    c, cc = cu.to(torch.int64), cuc.to(torch.int64)
    n = c[1:] - c[:-1]
    bad = (c[0] != 0) | (cc[0] != 0) | (c[-1] > num_tokens) | (cc[-1] > total_comp) \
        | (n < 0).any() | ((cc[1:] - cc[:-1]) != torch.div(n, ratio, rounding_mode="floor")).any()
    # an added NaN, not a select: the gradient of ``t`` turns NaN too
    return t + torch.where(bad, float("nan"), 0.0).to(t.dtype)
