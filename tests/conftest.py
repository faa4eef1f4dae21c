"""Test set-up shared by every test module.

The torchvision shim must run before anything imports sglang: PyPI's torchvision is a CUDA build whose _C.so
cannot load against CPU torch, and its meta registrations then fail on `torchvision::nms`. SGLang imports
torchvision unconditionally (sglang/srt/configs -> internvl_utils), though it only needs pure-Python parts.
Defining the two op schemas first is enough (ci/cpu_shim/_sglang_trtllm_moe_cpu_shim.py does the same for every
process of a CI env).

Torch threads: the pytest process is a harness process like the others (docs/TESTING.md): single-threaded torch
(SGLANG_TRTLLM_MOE_TEST_THREADS, default 1), and through OMP_NUM_THREADS every process a test starts too (each
test's own environment may still set it). On the 2-core box two matrix jobs run side by side; with torch's default
of one OpenMP thread per core their spinning workers wait for each other's cores: tests/test_concurrency.py and
tests/test_nvfp4_layer.py took 97 s of CPU with two threads, 37 s with one (tests/test_concurrency.py still finds
every race of a layer without its lock).
"""

import os

import pytest

_THREADS = max(1, int(os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1")))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

import torch  # noqa: E402  (after OMP_NUM_THREADS)

torch.set_num_threads(_THREADS)

if torch.version.cuda is None:  # a CPU torch: torchvision's CUDA _C.so cannot load (with CUDA torch it must, first)
    from sglang_trtllm_moe.sandbox.standins import torchvision_op_schemas

    torchvision_op_schemas()


def _sm100_reason():
    if not torch.cuda.is_available():
        return "needs an NVIDIA Blackwell GPU (SM100, compute capability 10.x): no CUDA device on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"needs an NVIDIA Blackwell GPU (SM100, compute capability 10.x): this GPU is SM{major}{minor}"
    return None


def pytest_configure(config):
    # release ranges / capabilities per test, and why a test does not apply here (the compat matrix)
    from tests.support import matrix

    config.pluginmanager.register(matrix, "sglang_trtllm_moe_compat_matrix")


def pytest_collection_modifyitems(config, items):
    reason = _sm100_reason()
    if reason is None:
        return
    for item in items:
        if "requires_sm100" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _no_weight_update_session_leaks():
    """A test that fails inside a begin/end weight-update session must not leave the process-wide session open
    (every later flush would be deferred)."""
    yield
    import sys

    state = sys.modules.get("sglang_trtllm_moe.layer_state")
    if state is not None:
        state.SESSION["open"] = False
