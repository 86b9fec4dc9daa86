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
