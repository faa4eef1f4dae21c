"""The CPU stand-ins of the harness: they live with the product (`compat.cpu_sandbox`, which `plugin.register()`
activates in every process SGLang starts when SGLANG_TRTLLM_MOE_EMULATE=1 and SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100
are set); this name keeps the harness's imports working.

`spawn_path()` is the older way to reach spawned processes, kept for tests that want the stand-ins without the
faked platform: a directory to put on PYTHONPATH holding a tiny distribution whose `sglang.srt.plugins` entry point
calls `plugin_entry()` (the stand-ins; and the sandbox when both switches are set). Nothing is active in a normal
installation: the distribution exists only in that temporary directory.
"""

from __future__ import annotations

import os

from ..compat.cpu_sandbox import (
    ENV_FAKE_SM,
    STANDINS,
    activate,
    activate_from_env,
    apply,
    cpu_mm_out_dtype,
    deepseek_mla_on_torch_native,
    requested_sm,
    topk_bypass_on_cpu,
    torchvision_op_schemas,
    vllm_custom_ops_import_stub,
)


def plugin_entry() -> None:
    """`sglang.srt.plugins` entry point of the spawn-time distribution (see `spawn_path`): the stand-ins, and the
    whole sandbox (faked SM100) when both test-only switches are set — what the plugin's own register() does then."""
    apply()
    activate_from_env()


SPAWN_DIST = "sglang_trtllm_moe_cpu_standins"


def spawn_path(root: str | None = None) -> str:
    """A directory to prepend to PYTHONPATH so processes SGLang spawns apply the stand-ins: it holds only a
    `*.dist-info` declaring a `sglang.srt.plugins` entry point `cpu_standins = sglang_trtllm_moe.sandbox.standins:
    plugin_entry`. SGLang's `load_plugins()` (first thing in every scheduler / detokenizer process) runs it."""
    import tempfile

    root = root or tempfile.mkdtemp(prefix="sglang-trtllm-moe-standins-")
    info = os.path.join(root, f"{SPAWN_DIST}-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {SPAWN_DIST}\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\ncpu_standins = sglang_trtllm_moe.sandbox.standins:plugin_entry\n")
    return root


__all__ = [
    "ENV_FAKE_SM",
    "SPAWN_DIST",
    "STANDINS",
    "activate",
    "activate_from_env",
    "apply",
    "cpu_mm_out_dtype",
    "deepseek_mla_on_torch_native",
    "plugin_entry",
    "requested_sm",
    "spawn_path",
    "topk_bypass_on_cpu",
    "torchvision_op_schemas",
    "vllm_custom_ops_import_stub",
]
