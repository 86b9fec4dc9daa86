import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# CSA_CONFIG="K=V,..." runs the whole suite under a variant tuning (kernels/tuning.py
# reads it at import; the compile cache keys on the tuning).

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def megatron_csa(tmp_path_factory):
    """Megatron-LM's csa module with a one-process group (tests/megatron_env.py), or a
    skip where no Megatron tree imports. Without CUDA, torch.cuda.current_device points at
    the CPU for the module's tests (Megatron allocates ape and its rotary tables there)."""
    from megatron_env import import_csa, init_one_process

    mod = import_csa()
    if mod is None:
        pytest.skip("no importable Megatron-LM tree (MEGATRON_LM_PATH, or ../shared/megatron)")
    init_one_process(tmp_path_factory.mktemp("gloo"))
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        yield mod


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused path on the CPU: the device checks passed over and the launch replaced by
    the reference of its numerics on the validated problem (the kernels' contract), so the dispatch
    and its callers can be driven without a GPU. Yields the row counts launched."""
    from csa_compressor import dispatch, grouped, ops, reference, runtime, validation

    def validate_any_device(*a, for_kernel=False, **k):
        return validation.validate(*a, **k)

    def validate_packed_any_device(*a, for_kernel=False, **k):
        return validation.validate_packed(*a, **k)

    def validate_sbhd_any_device(*a, for_kernel=False, **k):
        return validation.validate_sbhd(*a, **k)

    launched = []

    def launch(p, finish=None):
        rows = pool(p)
        # with the epilogue: the kernels' contract is the epilogue node on the pooled rows
        return rows if finish is None else finish.check(p).apply(rows)

    def pool(p):
        mode = reference.MODE_OF_NUMERICS[p.numerics]  # the kernels' rounding
        if p.batch:  # SBHD: the caller's (S, B, ...) tensors
            launched.append(p.total_comp * p.batch)
            kv, score = p.full or validation.halves(p.kvs, p.score_first)
            return reference.compress_sbhd(kv, score, p.ape, ratio=p.ratio, coff=p.coff, mode=mode)
        launched.append(p.total_comp)
        if p.offsets_built and p.coff == 1 and bool((p.cu_seqlens < 0).any()):
            return rows_by_window(p, mode)
        # packed: the caller's kvs is what the op differentiates (the problem's halves are
        # the kernels' untracked views)
        kv, score = (p.kv, p.score) if p.kvs is None else validation.halves(p.kvs, p.score_first)
        return reference.compress_thd(kv, score, p.ape, p.cu_seqlens, p.cu_seqlens_comp,
                                      p.total_comp, ratio=p.ratio, coff=p.coff, mode=mode)

    def rows_by_window(p, mode):
        """The kernels' rows where the offsets are no pack's (streaming's in-place decode,
        coff 1): row by row, segment ``s`` by ``cu_seqlens_comp``, its window from
        ``cu_seqlens[s]`` where that lies in the tokens, zeros where it does not (padding
        rows: the window at token 0)."""
        import bisect

        cu, cuc, r, T = p.cu_seqlens.tolist(), p.cu_seqlens_comp.tolist(), p.ratio, p.num_tokens
        one = torch.tensor([0, r], dtype=torch.int32)
        out = p.kv.new_zeros((p.total_comp, p.head_dim))
        for row in range(p.total_comp):
            s = bisect.bisect_right(cuc, row) - 1
            t0 = cu[s] + (row - cuc[s]) * r if s < len(cu) - 1 else 0
            if 0 <= t0 <= T - r:
                out[row] = reference.compress_thd(p.kv[t0:t0 + r], p.score[t0:t0 + r], p.ape, one,
                                                  one // r, 1, ratio=r, coff=1, mode=mode)[0]
        return out

    monkeypatch.setattr(runtime, "device_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "validate", validate_any_device)
    monkeypatch.setattr(dispatch, "validate_packed", validate_packed_any_device)
    monkeypatch.setattr(dispatch, "validate_sbhd", validate_sbhd_any_device)
    # the public ops' own kernel checks too (compress_thd_fused and the SBHD op called directly)
    monkeypatch.setattr(ops, "validate", validate_any_device)
    monkeypatch.setattr(ops, "validate_sbhd", validate_sbhd_any_device)
    monkeypatch.setattr(ops, "validate_packed", validate_packed_any_device)
    monkeypatch.setattr(ops, "fused_from_problem", launch)
    # compress_grouped's problem of built offsets (grouped._fused)
    monkeypatch.setattr(grouped, "validate", validate_any_device)
    monkeypatch.setattr(grouped, "fused_from_problem", launch)
    # streaming's kept forward (streaming.rows.pool_kept): the problem's specialisation
    # stands for the compiled kernel, the reference for its launch
    from csa_compressor.streaming import rows as stream_rows

    def kept_launch(found, tuning, n_rows, kv, score, ape, cu, cuc, out):
        ratio, coff, head_dim, numerics = found
        p = validation.Problem(kv, score, ape, cu, cuc, n_rows, ratio, coff, head_dim,
                               numerics=numerics)
        return out.copy_(pool(p))

    monkeypatch.setattr(stream_rows, "forward_kernel",
                        lambda p: (p.ratio, p.coff, p.head_dim, p.numerics))
    monkeypatch.setattr(stream_rows, "launch_kept", kept_launch)
    import kernel_standin
    from csa_compressor import kernel_api

    monkeypatch.setattr(kernel_api, "pool_forward", lambda *a, **k: launched.append(
        a[5].shape[0]) or kernel_standin.pool_forward(*a, **k))
    monkeypatch.setattr(kernel_api, "pool_backward", kernel_standin.pool_backward)
    yield launched


@pytest.fixture
def hadamard_standin(megatron_csa, monkeypatch):
    """Megatron's ``rotate_activation`` (rotate=True) calls fast_hadamard_transform, a CUDA
    package on no machine here: the same transform in plain torch (unnormalised Walsh-
    Hadamard times ``scale``, fp32 math, the input's dtype out, differentiable) stands in,
    the same for Megatron's eager code and the installed adapter."""
    import importlib

    from csa_compressor.epilogue import walsh_hadamard

    dsa = importlib.import_module(megatron_csa.__name__.rsplit(".", 1)[0] + ".dsa")

    calls = []

    def transform(x, scale=1.0):
        calls.append(tuple(x.shape))
        return (walsh_hadamard(x) * scale).view(x.shape).to(x.dtype)

    monkeypatch.setattr(dsa, "hadamard_transform", transform)
    return calls


@pytest.fixture
def hf_clean():
    """csa_compressor.transformers uninstalled, its reasons cleared, around a test."""
    from csa_compressor import transformers as csa_hf

    csa_hf.uninstall()
    csa_hf.clear_fallback_reasons()
    yield
    csa_hf.uninstall()


@pytest.fixture
def stub_csa(monkeypatch):
    """A stand-in for Megatron's csa module: just the names the adapter needs."""
    import types

    from csa_compressor import megatron

    mod = types.ModuleType(megatron.hooks.CSA_MODULE)
    original = lambda *a, **k: None  # noqa: E731

    class Compressor:
        def _forward_sbhd(self, x):
            return "eager"

    mod.maybe_compress_thd_fused, mod.Compressor = original, Compressor
    monkeypatch.setitem(sys.modules, megatron.hooks.CSA_MODULE, mod)
    yield mod, original
    megatron.uninstall()
