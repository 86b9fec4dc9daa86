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
