"""SGLang's weight cache (`--weight-cache-mode daemon | client`, 0.5.17+), which the plugin cannot serve: a scheduler
maps its weights from the weight-cache daemon and skips process_weights_after_loading (weight_cache/ipc_loader.py
`IpcModelLoader.load_model`), and the daemon prepares them with SGLang's own code without loading plugins
(weight_cache/daemon.py; compat.features.WEIGHT_CACHE checks both facts against the installed SGLang). Said up front:
the auto-selection keeps SGLang's choice (WEIGHT_CACHE_KEEPS_UPSTREAM: tests/test_selection.py resolves it through
SGLang's own ServerArgs), and the first MoE layer built in such a process logs one warning saying what that means.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_trtllm_moe.builtins import loader_hooks
from sglang_trtllm_moe.compat import features, platform
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

pytestmark = pytest.mark.sglang(
    features.WEIGHT_CACHE.releases, reason="--weight-cache-mode exists from SGLang 0.5.17 (features.WEIGHT_CACHE)"
)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


@pytest.mark.parametrize("mode", ["client", "daemon", "off"])
def test_the_first_moe_layer_of_a_weight_cache_process_says_the_plugin_prepares_nothing(mode, monkeypatch, caplog):
    monkeypatch.setattr(platform, "published_server_args", lambda: SimpleNamespace(weight_cache_mode=mode))
    monkeypatch.setattr(loader_hooks, "WEIGHT_CACHE_WARNED", [])
    caplog.set_level(logging.WARNING, logger="sglang_trtllm_moe")
    for _ in range(2):  # once per process, not per layer
        cpu_layers.build_layer(cpu_layers.MoeSpec())
    lines = [r.getMessage() for r in caplog.records if "weight-cache-mode" in r.getMessage()]
    assert loader_hooks.WEIGHT_CACHE_WARNED == [mode]
    if mode == "off":
        assert lines == []
        return
    (line,) = lines
    assert f"--weight-cache-mode {mode}" in line and "skips process_weights_after_loading" in line, line
    assert "without loading plugins" in line and "--weight-cache-mode off for RL" in line, line


def test_the_published_mode_is_read_from_this_process_server_args(monkeypatch):
    monkeypatch.setattr(platform, "published_server_args", lambda: SimpleNamespace(weight_cache_mode="client"))
    assert platform.weight_cache_mode() == "client"
    assert platform.weight_cache_mode(SimpleNamespace(weight_cache_mode=None)) == "off"
    monkeypatch.setattr(platform, "published_server_args", lambda: None)
    assert platform.weight_cache_mode() == "off"
