import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# CSA_CONFIG="K=V,..." runs the whole suite with kernels/config.py constants overridden
# (a candidate behind a flag), before anything compiles: the compile cache is not keyed
# by them.
if os.environ.get("CSA_CONFIG"):
    from csa_compressor.kernels import config as _config

    _config.override(os.environ["CSA_CONFIG"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
