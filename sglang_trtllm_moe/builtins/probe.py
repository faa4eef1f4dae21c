"""A harmless real target that proves the hook mechanism end to end on every supported release.

It counts calls to `initialize_moe_config` (present and stable in every release 0.5.11+, called once per
scheduler process) without changing its behaviour. It stays until the capability hooks replace it as the
mechanism's witness; tests assert it lands and counts.
"""

from __future__ import annotations

from .. import hookimpl
from ..targets import HookTarget

CALLS = {"initialize_moe_config": 0}


def count_initialize_moe_config(original, *args, **kwargs):
    CALLS["initialize_moe_config"] += 1
    return original(*args, **kwargs)


@hookimpl
def register_sglang_hooks(register, release):
    register(
        HookTarget(
            target="sglang.srt.layers.moe.utils.initialize_moe_config",
            hook=count_initialize_moe_config,
            hook_type="around",
            releases=">=0.5.11",
            capability="core",
            why="witness that HookRegistry applied our hooks (counts calls, changes nothing)",
        )
    )
