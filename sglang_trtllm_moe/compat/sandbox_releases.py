"""What the CPU sandbox (sglang_trtllm_moe/sandbox/) knows about SGLang releases, in one place: how a process is stood
up on each release (named flags, as compat/features.py holds the product's; tests/test_compat_features.py checks
each against the installed SGLang's code), and which releases the model and Engine harnesses speak.

Apart from compat/features.py because the product never reads these (only sandbox/runtime.py, models.py, engine.py,
bench.py and the tests' release markers do); in compat/ because every release-range literal of the package lives
there (tests/test_house_rules.py).

"Add an SGLang release" (docs/ARCHITECTURE.md) reads this module with compat/features.py: a flag whose fact moved
gets its range widened or closed; the two harness ranges are open-ended, so a new release is in them until the model
or Engine tests fail on it — then the range closes with the reason.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from .features import Feature

# ---- how a process is stood up (sandbox/runtime.py) ------------------------------------------------------------

PUBLISH_WITH_RANKS = Feature(
    ">=0.5.21",
    "ServerArgs are published with runtime_context.publish(ranks=SpawnRanks); before with "
    "set_global_server_args_for_scheduler",
)
MOE_CONFIG_TAKES_ARGS = Feature("<0.5.19", "initialize_moe_config(server_args) takes the ServerArgs")
SWIZZLE_MOVES_TO_CUDA = Feature(
    "<0.5.20",
    "quantization.utils.swizzle_blockscale ends in .cuda(), so NVFP4 create_weights cannot run without a GPU",
)

# ---- the releases each harness speaks (not a fact of one SGLang function: the harness's tests are the check) -------

#: sandbox/models.py: SGLang's ModelRunner set up as its bench_one_batch sets one up (bootstrap.init_parallel_runtime,
#: runtime_context.publish(role="scheduler", ranks=SpawnRanks)); older releases spell publishing, bootstrap and the
#: runner differently and raise NotImplementedError naming the release
MODEL_RUNNER_RELEASES = SpecifierSet(">=0.5.21")
#: sandbox/engine.py: sglang.Engine(device="cpu") driven through its public API (begin/end weight-update sessions,
#: the weight-checker request, the Engine's spawn flow as 0.5.23 spells it); the demo, the README's example and the
#: Engine / HTTP-server tests run on these releases
ENGINE_RELEASES = SpecifierSet(">=0.5.23")


def all_features() -> dict[str, Feature]:
    return {name: f for name, f in globals().items() if isinstance(f, Feature)}


__all__ = ["ENGINE_RELEASES", "MODEL_RUNNER_RELEASES", "all_features", *all_features()]
