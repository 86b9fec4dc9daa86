"""Megatron-LM's CSA/HCA ``Compressor`` on the fused kernels.

    from csa_compressor import megatron
    megatron.install()          # or: with megatron.installed(): ...

Megatron's ``Compressor._forward_thd`` calls the module-global
``csa.maybe_compress_thd_fused(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp,
ratio=, head_dim=, coff=, enabled=)`` and runs its eager region when that returns None.
``install()`` replaces that name with this package's adapter, which returns the fused
pooling for every ratio / coff / dtype / head_dim the kernels take (Hopper and
Blackwell), under deterministic mode and ``torch.compile`` too, and None otherwise, with
the reason logged once and kept (``fallback_reasons()``).

Megatron's own ``enabled`` argument (``use_fused_dsa_kernels(config)``, False unless a
DSA kernel backend is configured) is ignored by default: ``install()`` is the opt-in.
``install(respect_enabled=True)`` honours it instead.

SBHD inputs (``Compressor._forward_sbhd``, which has no hook) are routed too: ``install()``
replaces that method with one that runs Megatron's own projections, norm, rotary
embedding and rotation around the fused pooling of the ``b`` sequences of ``sq`` tokens
(the projections' ``(sq, b, coff*d)`` outputs read in place: compress_sbhd_fused; a
transposed copy into the THD layout where their rows are not 16-byte multiples), and
calls Megatron's method unchanged wherever the fused pooling cannot run.

The context-parallel path (``Compressor._forward_thd(..., compressed_group_ids=ids)``,
rows already packed in groups of ``ratio`` tokens, which skips the hook) is routed too:
``install()`` wraps ``_forward_thd`` so that pre-grouped calls run Megatron's projections,
the fused pooling of the groups (a THD pack on device-built offsets, no host sync), then
its norm, rotary embedding at ``max(id, 0) * ratio`` and rotation; other calls go to
Megatron's method unchanged. One row differs by design: where ``ids[0] != 0`` Megatron's
eager code fills row 0's previous-block slots from the buffer's last group
(``torch.roll``), here they are empty (a first block). In Megatron's layout that row is the
previous rank's halo (its boundary window is ``2 * ratio`` tokens at ratio 4, the only
overlapping ratio), so its output is never consumed and takes no gradient.

``install(epilogue=True)`` also replaces what follows the pooling on all three paths:
Megatron's norm, rotary embedding and rotation run as this package's fused epilogue
(``apply_epilogue``: fp32 math, one rounding; Megatron rounds after the norm and at each
step of its bf16 rotary embedding), with Megatron's own norm weight and eps, its rotary
frequencies (read from its rotary module, so YaRN included) and its positions. Where its
configuration is one the epilogue does not compute (another norm, zero-centred gamma,
interleaved rotary tables, interpolated positions, context parallelism outside the
pre-grouped path), Megatron's own epilogue runs after the fused pooling and
``fallback_reasons()`` says why.

``install(projection=True)`` runs Megatron's two projections (``linear_wkv``,
``linear_wgate``) as one GEMM into ``[kv | score]`` on all three paths, whose halves the
pooling reads in place: the backward then has one input-gradient GEMM and no add of two
``(T, hidden)`` gradients. It reads the two linears' weights (their concatenation a step,
or in place where one follows the other in memory) and takes their gradients through
autograd (``.grad``, which Megatron's DDP hooks add into ``main_grad``). Where the linears
do more than a plain GEMM (a bias, sequence or tensor parallelism, fp8,
``delay_wgrad_compute``), Megatron's linears run and ``fallback_reasons()`` says why.
With both, ``install(epilogue=True, projection=True)``, Megatron's Compressor computes
what this package's ``Compressor`` computes with its parameters.

``install(numerics="eager")`` has the fused pooling round the softmax weights and products
to the dtype as Megatron's eager region does; alone (no epilogue, no projection) Megatron's
Compressor then computes what it computes without this package, its ape gradient summed
in another order.

DeepSeek-V4.1's ``CSA2Compressor`` (where the tree has Megatron's csa2 module) is routed
too: its ``forward`` and ``forward_packed`` pool through the fused kernels with no position
bias (megatron/csa2.py); its projections and norm run as Megatron's. Ratio 1 (no pooling)
and CPU inputs keep Megatron's code, with the reason in ``fallback_reasons()``.

Megatron is imported only by ``install()``, never by ``import csa_compressor``.
"""

from __future__ import annotations

from ..install_scope import installed_for_block
from . import csa2
from .hooks import HOOK, csa_module, forward_sbhd, forward_thd, maybe_compress_thd_fused
from .state import Options, installed as _installed, reasons as _reasons

__all__ = ["Options", "clear_fallback_reasons", "fallback_reasons", "install", "installed",
           "is_installed", "uninstall"]


def fallback_reasons() -> dict:
    """Each reason a call kept Megatron's eager pooling (or, prefixed ``"epilogue: "``,
    Megatron's own norm, RoPE and rotation under ``install(epilogue=True)``; prefixed
    ``"projection: "``, its own two linears under ``install(projection=True)``), with how
    many calls it was."""
    return dict(_reasons)


def clear_fallback_reasons() -> None:
    """Forget the reasons recorded so far (each is logged again the next time it occurs)."""
    _reasons.clear()


def install(respect_enabled: bool = False, epilogue: bool = False,
            projection: bool = False, numerics: str = "fp32") -> None:
    """Route Megatron's Compressor through the fused kernels (idempotent). ``epilogue``: its
    norm, RoPE and rotation too (fp32 math, one rounding), not only the pooling.
    ``projection``: its two linears as one GEMM. ``numerics``: the fused pooling's, "fp32"
    (what Megatron's own fused path computes) or "eager" (rounded as its eager region
    rounds: alone, Megatron's Compressor then computes what it does without fused kernels).
    The options are kept as one frozen Options value."""
    opts = Options(respect_enabled, epilogue, projection, numerics)
    mod = csa_module()
    if _installed["module"] is None:
        _installed["module"], _installed["original"] = mod, getattr(mod, HOOK)
        _installed["sbhd"] = getattr(mod.Compressor, "_forward_sbhd", None)
        _installed["thd"] = getattr(mod.Compressor, "_forward_thd", None)
    _installed["options"] = opts
    setattr(mod, HOOK, maybe_compress_thd_fused)
    if _installed["sbhd"] is not None:
        mod.Compressor._forward_sbhd = forward_sbhd
    if _installed["thd"] is not None:
        mod.Compressor._forward_thd = forward_thd
    v41 = csa2.csa2_module()
    if v41 is not None:
        csa2.patch(v41)


def uninstall() -> None:
    """Restore Megatron's own hook (a no-op when not installed)."""
    if _installed["module"] is not None:
        setattr(_installed["module"], HOOK, _installed["original"])
        for name in ("sbhd", "thd"):
            if _installed[name] is not None:
                setattr(_installed["module"].Compressor, f"_forward_{name}", _installed[name])
        _installed.update(module=None, original=None, sbhd=None, thd=None, options=Options())
    csa2.unpatch()


def is_installed() -> bool:
    return _installed["module"] is not None


def installed(respect_enabled: bool = False, epilogue: bool = False, projection: bool = False,
              numerics: str = "fp32"):
    """``install()`` for the block, then Megatron's hook back as it was."""
    return installed_for_block(_installed, is_installed,
                               lambda: install(respect_enabled, epilogue, projection, numerics),
                               uninstall)
