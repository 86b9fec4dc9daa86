"""The numerics contract (README, "Numerics") as reusable checks, used by `check` and the bench gate."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of a's dtype at the larger magnitude (0 where equal)."""
    dt = a.dtype
    a64, b64 = a.double(), b.double()
    diff = (a64 - b64).abs()
    scale = torch.maximum(a64.abs(), b64.abs()).clamp_min(torch.finfo(dt).tiny)
    ulp = torch.finfo(dt).eps * torch.exp2(torch.floor(torch.log2(scale)))
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    return torch.where(same, torch.zeros_like(diff), diff / ulp)


@dataclass
class OutputReport:
    name: str
    bitwise: bool
    n_diff: int
    numel: int
    max_ulp: float
    err_fp32: float  # max |fp32 reference - fp64 oracle|
    err_upstream: float
    err_fused: float
    failures: list = field(default_factory=list)


def compare(name, fused, ref32, upstream, oracle, *, clause: str, atol: float = 1e-3,
            against_upstream: bool = True, reference: str = "torch's fp32 region") -> OutputReport:
    """``clause``: "bitwise" (dkv, dscore), "ulp" (the forward: at most max(1, 0.1%)
    elements differ, by one unit in the last place; fp32 outputs every element within 4
    units), or "atol" (dape). ``ref32`` is torch's eager fp32 region on the same device.
    ``against_upstream``: apply the fp64 clause (fused L1 error never above upstream's);
    for fp32 inputs upstream differs from the fp32 reference only in summation order, so
    the clause is a coin toss there and is skipped."""
    neq = ~((fused == ref32) | (torch.isnan(fused) & torch.isnan(ref32)))
    n_diff = int(neq.sum())
    max_ulp = float(ulp_diff(fused[neq], ref32[neq]).max()) if n_diff else 0.0
    o = oracle.double()

    def err(x):
        return float((x.double() - o).abs().sum()) if x.numel() else 0.0

    rep = OutputReport(name, n_diff == 0, n_diff, fused.numel(), max_ulp, err(ref32), err(upstream), err(fused))
    if clause == "bitwise" and n_diff:
        rep.failures.append(f"{name}: {n_diff} elements differ from {reference} (bitwise owed)")
    if clause == "ulp" and fused.dtype == torch.float32:
        if n_diff and max_ulp > 4.0:
            rep.failures.append(f"{name}: max difference {max_ulp:.2f} ulp (at most 4 allowed in fp32)")
    elif clause == "ulp":
        if n_diff > max(1, int(0.001 * fused.numel())):
            rep.failures.append(f"{name}: {n_diff}/{fused.numel()} elements differ (at most 0.1% allowed)")
        if n_diff and max_ulp > 1.0:
            rep.failures.append(f"{name}: max difference {max_ulp:.2f} ulp (at most 1 allowed)")
    if clause == "atol":
        dmax = float((fused.double() - ref32.double()).abs().max()) if fused.numel() else 0.0
        if dmax > atol:
            rep.failures.append(f"{name}: max |fused - {reference}| = {dmax:.3g} > {atol}")
    if against_upstream and rep.err_fused > rep.err_upstream * (1 + 1e-9) + 1e-30:
        rep.failures.append(
            f"{name}: L1 error vs fp64 {rep.err_fused:.4g} above upstream's {rep.err_upstream:.4g}")
    return rep
