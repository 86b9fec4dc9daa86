"""decode's one-launch path (``pooling="ring"``): kernels/pool_decode reads the slots'
rings in place, so a step is one kernel (and the epilogue's) where the gather path is
some thirty small ones. The rows are the training forward's rows (the forward's row math,
in its order)."""

from __future__ import annotations

import torch

from ..epilogue_op import apply_epilogue
from ..kernels.launch import decode_kernel, launch_decode
from .windows import min_rows


def launcher(state, kv, score, ape, settings):
    """The compiled step for this call, or None where it takes the gather path: not the
    fused path (``settings``, rows.Settings), no entries, inputs not contiguous or not
    16-byte aligned, an APE the kernels cannot read, a window or row the kernel does not hold
    (plan.decode_designable), or no compiled kernel while a CUDA graph captures."""
    if not settings.fused or state.device.type != "cuda" or kv.shape[0] == 0:
        return None
    for t in (kv, score) + (() if ape is None else (ape,)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return None
    if ape is not None and (ape.dtype != torch.float32 or ape.device != state.device
                            or tuple(ape.shape) != (state.ratio, state.width)):
        return None
    return decode_kernel(state.device, state.dtype, state.ratio, state.coff, state.head_dim,
                         settings.numerics)


def step(c, state, kv, score, idx: torch.Tensor, settings):
    """Run compiled step ``c`` for entries ``idx`` (int64 slots on the device, unchecked:
    the kernel makes malformed entries NaN and their slots bad) with ``settings``'
    (rows.Settings) APE and epilogue. Returns (rows ``(B, R, head_dim)``, emitted ``(B,
    R)``, positions ``(B, R)``). With the epilogue the pooled rows take it by parts, as
    the training op's do where its kernels do not hold it: a pack padded past the norm's
    few-row orders (windows.min_rows), rows not emitted at position 0."""
    B, n, W = kv.shape
    R, d, dev = -(-n // state.ratio), state.head_dim, state.device
    ape = settings.ape
    if ape is None:  # a zero APE adds what the no-APE kernels add (the guard's flag, 0)
        ape = state.constants.get("zero_ape")
        if ape is None:
            ape = state.constants["zero_ape"] = torch.zeros((state.ratio, W), dtype=torch.float32,
                                                            device=dev)
    ep = settings.epilogue
    cap = min_rows(B * R, d, True) if ep is not None else B * R
    if ep is not None:  # padding rows stay zero: the kernel writes the first B * R
        out = torch.zeros((cap, d), dtype=state.dtype, device=dev)
        positions = torch.zeros(cap, dtype=torch.int64, device=dev)
    else:
        out = torch.empty((cap, d), dtype=state.dtype, device=dev)
        positions = torch.empty(cap, dtype=torch.int64, device=dev)
    emitted = torch.empty(B * R, dtype=torch.uint8, device=dev)
    launch_decode(c, (state.kv.view(-1, W), state.score.view(-1, W)),
                  (kv.view(B * n, W), score.view(B * n, W)), ape, idx.contiguous(),
                  (state.count, state.last_n, state.bad.view(torch.uint8)),
                  (out, emitted, positions), n, state.history, state.position_limit)
    if ep is not None:
        out = apply_epilogue(out, settings.norm_weight, positions, ep,
                             rope_table=settings.rope_table)
    return (out[:B * R].view(B, R, d), emitted.view(torch.bool).view(B, R),
            positions[:B * R].view(B, R))
