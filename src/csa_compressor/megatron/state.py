"""What install() set: Megatron's module with its original methods, the options (one
frozen value), and the reasons calls kept Megatron's own code."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..checks import check_flag, check_pool_numerics

_log = logging.getLogger("csa_compressor.megatron")
DISABLED = "disabled by Megatron (use_fused_dsa_kernels is False)"
EPILOGUE = "epilogue: "  # the prefix of the reasons Megatron's own epilogue ran
PROJECTION = "projection: "  # ... and its own two linears


@dataclass(frozen=True)
class Options:
    """install()'s options: ``respect_enabled`` (honour Megatron's ``enabled``),
    ``epilogue`` (its norm, RoPE and rotation fused too), ``projection`` (its two linears as
    one GEMM), ``numerics`` (the fused pooling's: "fp32" or "eager")."""

    respect_enabled: bool = False
    epilogue: bool = False
    projection: bool = False
    numerics: str = "fp32"

    def __post_init__(self):
        for name in ("respect_enabled", "epilogue", "projection"):
            check_flag(name, getattr(self, name))
        check_pool_numerics(self.numerics)


# The one record of the installation (Megatron's methods are patched process-wide, so the
# record is too): "module", "original", "sbhd", "thd" (Megatron's own hook and methods),
# "options"; "csa2": the V4.1 compressor's class and original methods where patched.
installed: dict = {"module": None, "original": None, "sbhd": None, "thd": None,
                   "options": Options(), "csa2": None}
reasons: dict = {}


def options() -> Options:
    return installed["options"]


def fallback(reason: str):
    """Record (and log once) why a call kept Megatron's own code; returns None."""
    if reason not in reasons:
        what = ("its norm, RoPE and rotation" if reason.startswith(EPILOGUE)
                else "its two linears" if reason.startswith(PROJECTION) else "its eager pooling")
        _log.warning("csa_compressor: Megatron's Compressor keeps %s: %s", what, reason)
        reasons[reason] = 0
    reasons[reason] += 1
    return None
