"""tests/gpu/: a real SGLang on a CUDA GPU with CUDA graphs on, through the plugin's path (docs/TESTING.md "On a GPU").

Skipped, with the reason, where there is no CUDA GPU (every CI box): ci/gpu-run runs them on the lent H200 (or any
H100 / H200) after installing the wheels ci/gpu-wheels prepared.
"""

from __future__ import annotations

import pytest
import torch

GPU_REASON = "needs a CUDA GPU (SGLang with CUDA graphs; the lent H200 runs these through ci/gpu-run)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=GPU_REASON))
