"""The rows of a streaming pack: the training op's pooling (fused, or the plain-torch
reference) and the same epilogue, at positions the stream gives."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import dispatch, ops, reference, runtime
from ..checks import INT32_MAX, KERNEL_ALIGN_BYTES, check_pool_numerics
from ..epilogue import Epilogue
from ..epilogue_op import apply_epilogue
from ..fused_epilogue import EpilogueInside, Finish
from ..kernels.launch import forward_kernel, launch_kept
from ..pooling import with_numerics
from ..rotary import rope_inv_freq
from ..validation import Problem

# "auto" takes the one-launch kernels where they take the call (streaming/ring.py); "ring"
# is the same, the name it had while "auto" did not
POOLING = ("auto", "fused", "reference", "ring")


class Settings(NamedTuple):
    """What every row of one call is computed with (a NamedTuple: a frozen dataclass took
    four times its host time to build, once a call)."""

    ape: torch.Tensor
    ratio: int
    coff: int
    numerics: str
    epilogue: Epilogue | None
    norm_weight: torch.Tensor | None
    rope_table: tuple | None
    fused: bool
    inside: object = None  # the fused path's EpilogueInside (None: its default)
    # the caller's kv / score / ape as validated for the kernels (dispatch.unavailable), so
    # a pack of those tensors takes its problem without validating them again
    problem: object = None
    inv_freq: torch.Tensor | None = None  # the rotary frequencies kept (rope_freqs)


def _probe(state) -> torch.Tensor:
    """An int32 tensor on the state's device, made once: the offsets of the fused path's
    check, whose contents it does not read."""
    probe = state.constants.get("probe")
    if probe is None:
        probe = state.constants["probe"] = torch.zeros(2, dtype=torch.int32, device=state.device)
    return probe


def _layout(t) -> tuple | None:
    """What the kernels' check reads of ``ape``: its whole shape too (the kernels read
    ``ratio`` rows of it)."""
    if t is None:
        return None
    return (t.dtype, t.device, tuple(t.shape), t.is_contiguous(),
            t.data_ptr() % KERNEL_ALIGN_BYTES)


def fused_problem(state, kv, score, ape):
    """The fused path's validated problem for the caller's tensors, or None where the
    kernels cannot take them. The verdict is kept a state per tensor layout: validating
    anew cost some 35 µs of host time a prefill call on the H100 host, and the same
    tensors' layout gives the same verdict (only the row count and the kill switch,
    checked here each call, can change it). ``kv`` and ``score`` have the state's dtype,
    device and row width (prefill and decode check them first), so their contiguity and
    alignment are the rest of their layout."""
    if runtime.kill_switch_reason() or torch.compiler.is_compiling():
        return _validated(state, kv, score, ape)
    key = ("fused_problem", kv.is_contiguous(), kv.data_ptr() % KERNEL_ALIGN_BYTES,
           score.is_contiguous(), score.data_ptr() % KERNEL_ALIGN_BYTES, _layout(ape))
    memo = state.constants.get(key)
    if memo is None:
        p = _validated(state, kv, score, ape)
        # ape None: the empty stand-in validate made (never written), kept with the verdict
        memo = state.constants[key] = (p is not None, None if p is None else p.ape)
    ok, empty_ape = memo
    if not ok or kv.shape[0] * state.width > INT32_MAX:
        return None
    cu = _probe(state)
    return Problem(kv, score, empty_ape if ape is None else ape, cu, cu, 0, state.ratio,
                   state.coff, state.head_dim)


def _validated(state, kv, score, ape):
    # the probe stands for both offsets: their contents are not read here, and a None
    # cu_seqlens_comp would be derived on the device at every call
    cu = _probe(state)
    reason, problem = dispatch.unavailable(kv, score, ape, cu, cu, 0, state.ratio, state.coff,
                                           True)
    return problem if reason is None else None


def settings(state, kv, score, ape, numerics, epilogue, norm_weight, rope_table, pooling,
             epilogue_inside=None) -> Settings:
    """The call's settings, the pooling path chosen once for all its packs from the
    caller's inputs (``auto``: fused where the kernels take them), so that body and
    boundary rows come from one implementation."""
    check_pool_numerics(numerics)
    if pooling not in POOLING:
        raise ValueError(f"pooling: expected one of {POOLING}, got {pooling!r}")
    if epilogue is None:
        for name, v in (("norm_weight", norm_weight), ("rope_table", rope_table)):
            if v is not None:
                raise ValueError(f"{name}: given without epilogue=")
    elif not isinstance(epilogue, Epilogue):
        raise TypeError(f"epilogue: expected a csa_compressor.Epilogue, got {type(epilogue).__name__}")
    elif not isinstance(norm_weight, torch.Tensor):
        raise TypeError("norm_weight: expected a torch.Tensor with epilogue=")
    fused, problem = pooling == "fused", None
    if pooling in ("auto", "ring"):
        problem = fused_problem(state, kv, score, ape)
        fused = problem is not None
    return Settings(ape, state.ratio, state.coff, numerics, epilogue, norm_weight, rope_table,
                    fused, None if epilogue_inside is None else EpilogueInside.of(epilogue_inside),
                    problem, None if epilogue is None or rope_table is not None
                    else rope_freqs(state, epilogue))


def rope_freqs(state, ep: Epilogue) -> torch.Tensor | None:
    """``ep``'s rotary frequencies on the state's device (rotary.rope_inv_freq, the tensor
    the epilogue would make), made once a state and Epilogue and kept: made each step they
    were three to five more small kernels in a captured decode step. None without rotary,
    or while a graph captures or torch.compile traces before they were made (a tensor made
    then holds no values outside it): the epilogue then makes them, as it would."""
    if not ep.rope_dim:
        return None
    key = ("inv_freq", ep.rope_dim, ep.rope_theta, ep.rope_yarn)
    got = state.constants.get(key)
    if got is None and not state.capturing():
        got = state.constants[key] = rope_inv_freq(ep.rope_dim, ep.rope_theta, ep.rope_yarn,
                                                   device=state.device)
    return got


def _check_rows(n_rows: int, head_dim: int) -> None:
    """The output's elements must fit the kernels' int32 offsets (the caller's problem was
    validated with another row count)."""
    if n_rows * head_dim > INT32_MAX:
        raise ValueError(f"kv: {n_rows} rows of {head_dim} overflow int32 offsets")


def zero_ape(state) -> torch.Tensor:
    """The APE the kernels read for calls without one (zeros, as launch.ape_read makes for
    packs whose offsets the package built), made once a state."""
    ape = state.constants.get("zero_ape")
    if ape is None:
        ape = state.constants["zero_ape"] = torch.zeros((state.ratio, state.width),
                                                        dtype=torch.float32, device=state.device)
    return ape


def pool_kept(state, s: Settings, cu, cuc, n_rows: int) -> torch.Tensor:
    """pool_rows of a pack of the caller's own kv / score on the fused path, with no
    epilogue and no gradient: the kernel pool_rows launches (the same bits), found once a
    state and kept, as the tail kernel is (the plan's and the compile cache's lookups and
    the op's dispatch cost host time every call)."""
    p = s.problem
    _check_rows(n_rows, p.head_dim)
    key = ("forward", p.has_ape, s.numerics)
    found = state.constants.get(key)
    if found is None:
        found = state.constants[key] = forward_kernel(with_numerics(p, s.numerics))
    out = torch.empty((n_rows, p.head_dim), dtype=p.kv.dtype, device=p.kv.device)
    if n_rows:
        ape = p.ape if p.has_ape else zero_ape(state)
        launch_kept(found, p.tuning, n_rows, p.kv, p.score, ape, cu, cuc, out)
    return out


def pool_rows(s: Settings, kv, score, cu, cuc, n_rows: int, positions) -> torch.Tensor:
    """``(n_rows, head_dim)``: the pack's rows, through the epilogue where set. ``cu`` /
    ``cuc``: offsets the stream built from lengths it checked on the host, so the fused
    path skips the device-side offsets check (Problem.offsets_built)."""
    if s.fused:
        base = s.problem
        if base is not None and kv is base.kv and score is base.score:
            _check_rows(n_rows, base.head_dim)
            # a fresh Problem, not dataclasses.replace (4 µs of host time)
            p = Problem(base.kv, base.score, base.ape, cu, cuc, n_rows, base.ratio, base.coff,
                        base.head_dim)
        else:
            why, p = dispatch.unavailable(kv, score, s.ape, cu, cuc, n_rows, s.ratio, s.coff,
                                          True)
            if why is not None:  # settings chose the fused path for the caller's inputs
                raise ValueError(f"the streaming pack cannot take the fused pooling: {why}")
        p.offsets_built = True
        finish = None
        if s.epilogue is not None:
            finish = Finish(s.epilogue, s.norm_weight, positions, s.inv_freq,
                            rope_table=s.rope_table, inside=s.inside)
        return ops.fused_from_problem(with_numerics(p, s.numerics), finish)
    out = reference.compress_thd(kv, score, s.ape, cu, cuc, n_rows, ratio=s.ratio, coff=s.coff,
                                 mode=reference.MODE_OF_NUMERICS[s.numerics])
    if s.epilogue is None:
        return out
    return apply_epilogue(out, s.norm_weight, positions, s.epilogue, s.inv_freq,
                          rope_table=s.rope_table)
