"""What install() set: the compressor classes' own forwards, the options (one frozen value)
and the reasons calls kept transformers' own code."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..checks import check_pool_numerics

_log = logging.getLogger("csa_compressor.transformers")


@dataclass(frozen=True)
class Options:
    """install()'s options: ``numerics``, the fused pooling's rounding: "eager" (as
    transformers' own compressor rounds: weights and products in the input dtype, bit for
    bit its pooling) or "fp32" (exact fp32, one rounding)."""

    numerics: str = "eager"

    def __post_init__(self):
        check_pool_numerics(self.numerics)


# The one record of the installation (transformers' classes are patched process-wide, so
# the record is too): "classes" {class: its own forward}, "caches" {cache class: its own
# (reorder_cache, reset)}, "helpers" (transformers' rotary function), "options".
installed: dict = {"classes": {}, "caches": {}, "helpers": None, "options": Options()}
reasons: dict = {}


def options() -> Options:
    return installed["options"]


def fallback(reason: str):
    """Record (and log once) why a call kept transformers' own compressor; returns None."""
    if reason not in reasons:
        _log.warning("csa_compressor: transformers' DeepSeek-V4 compressor keeps its own "
                     "pooling: %s", reason)
        reasons[reason] = 0
    reasons[reason] += 1
    return None
