"""Hugging Face transformers' DeepSeek-V4 compressors on the fused kernels.

    from csa_compressor import transformers as csa_hf
    csa_hf.install()            # or: with csa_hf.installed(): ...

``install()`` replaces the ``forward`` of ``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor`` and ``DeepseekV4Indexer`` (its compressor at
``index_head_dim``): their pooling runs as this package's op, everything around it as
transformers computes it. Without a cache (training, a stateless forward) each batch row
is one sequence: the THD op over ``batch*seq`` rows, forward and backward fused. With a
cache (``generate()``) each compressor keeps a streaming state attached to its cache layer
(csa_compressor.streaming) and emits the rows training computes; ``reorder_cache`` and
``reset`` carry it along.

``numerics="eager"`` (the default) rounds as transformers' eager code does, bit for bit
its pooling; ``"fp32"`` pools in exact fp32 with one rounding. Where the fused pooling
cannot take a call (no CUDA GPU, a ``position_bias`` not kept in fp32, a cache that ran
transformers' own code before, autograd through a cache), the class's own forward runs and
``fallback_reasons()`` says why. transformers is imported only by ``install()``.
"""

from __future__ import annotations

import importlib

from ..install_scope import installed_for_block
from . import forwards, pooling
from .state import Options, installed as _installed, reasons as _reasons

__all__ = ["Options", "clear_fallback_reasons", "fallback_reasons", "install", "installed",
           "is_installed", "uninstall"]

MODEL_MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"
_FORWARDS = {"DeepseekV4HCACompressor": forwards.hca_forward,
             "DeepseekV4CSACompressor": forwards.csa_forward,
             "DeepseekV4Indexer": forwards.indexer_forward}
_CACHES = ("DeepseekV4HCACache", "DeepseekV4CSACache")


def _model_module():
    try:
        mod = importlib.import_module(MODEL_MODULE)
    except ImportError as exc:
        raise ImportError(f"csa_compressor.transformers: cannot import {MODEL_MODULE} ({exc}); "
                          "it needs transformers >= 5.23 (pip install 'csa_compressor[transformers]')"
                          ) from exc
    missing = [n for n in (*_FORWARDS, *_CACHES, "apply_rotary_pos_emb") if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"csa_compressor.transformers: {MODEL_MODULE} has no {', '.join(missing)}; "
                          "this transformers is not one the adapter knows")
    return mod


def _cache_method(cls, name, extra):
    own = getattr(cls, name)

    def method(self, *args, **kwargs):
        out = own(self, *args, **kwargs)
        extra(self, *args, **kwargs)
        return out

    method.__wrapped__ = own
    return method


def install(numerics: str = "eager") -> None:
    """Route transformers' DeepSeek-V4 compressors through the fused pooling (idempotent)."""
    opts = Options(numerics)
    mod = _model_module()
    if not _installed["classes"]:
        _installed["classes"] = {getattr(mod, n): getattr(mod, n).forward for n in _FORWARDS}
        _installed["caches"] = {getattr(mod, n): (vars(getattr(mod, n)).get("reorder_cache"),
                                                  vars(getattr(mod, n)).get("reset"))
                                for n in _CACHES[:1]}
        _installed["helpers"] = mod.apply_rotary_pos_emb
        for n, f in _FORWARDS.items():
            getattr(mod, n).forward = f
        # the CSA cache's methods call the HCA cache's (super()): wrapping the base alone
        # carries every layer's streams exactly once
        for n in _CACHES[:1]:
            cls = getattr(mod, n)
            if "reorder_cache" in vars(cls):
                cls.reorder_cache = _cache_method(cls, "reorder_cache",
                                                  lambda layer, beam_idx: pooling.reorder(layer, beam_idx))
            if "reset" in vars(cls):
                cls.reset = _cache_method(cls, "reset", lambda layer: pooling.reset(layer))
    _installed["options"] = opts


def uninstall() -> None:
    """Put transformers' own forwards back (a no-op when not installed)."""
    for cls, forward in _installed["classes"].items():
        cls.forward = forward
    for cls, (reorder, reset) in _installed["caches"].items():
        for name, own in (("reorder_cache", reorder), ("reset", reset)):
            if own is not None:
                setattr(cls, name, own)
    _installed.update(classes={}, caches={}, helpers=None, options=Options())


def is_installed() -> bool:
    return bool(_installed["classes"])


def fallback_reasons() -> dict:
    """Each reason a call kept transformers' own compressor, with how many calls it was."""
    return dict(_reasons)


def clear_fallback_reasons() -> None:
    _reasons.clear()


def installed(numerics: str = "eager"):
    """``install()`` for the block, then transformers' forwards back as they were."""
    return installed_for_block(_installed, is_installed, lambda: install(numerics), uninstall)
