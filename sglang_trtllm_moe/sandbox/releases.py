"""What the CPU sandbox (sglang_trtllm_moe/sandbox/) knows about SGLang releases, in one place: how a process is stood
up on each release (named flags, as compat/features.py holds the product's; tests/test_compat_features.py checks
each against the installed SGLang's code), and which releases the model and Engine harnesses speak.

Apart from compat/features.py because the product never reads these (only the sandbox's runtime.py, standins.py,
models.py, engine.py, bench.py and the tests' release markers do): the sandbox is an extension of the plugin, and this
is its one place for release facts, as compat/ is the runtime's (tests/test_house_rules.py: a release-range literal
lives in compat/ or here).

"Add an SGLang release" (docs/ARCHITECTURE.md) reads this module with compat/features.py: a flag whose fact moved
gets its range widened or closed; the two harness ranges are open-ended, so a new release is in them until the model
or Engine tests fail on it — then the range closes with the reason.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from ..compat.features import Feature

# ---- how a process is stood up (runtime.py, standins.py) ------------------------------------------------------------

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

BF16_GEMM_TORCH = Feature(
    ">=0.5.17",
    "--bf16-gemm-backend offers 'torch' (a faked SM100 otherwise resolves 'auto' to the cutedsl GEMM, which imports "
    "cuda.bindings); 0.5.15-0.5.16 offer auto / cutedsl only and 'auto' never imports cutedsl there; before 0.5.15 "
    "the argument does not exist",
)
DETOKENIZER_IMPORTS_XGRAMMAR = Feature(
    ">=0.5.16",
    "sglang.Engine's detokenizer reaches `from xgrammar import StructuralTag` at import "
    "(function_call/inkling_detector.py, through the function-call parsers); before, xgrammar is imported only by "
    "the grammar backend a constrained request builds",
)
HOST_KV_POOL_IMPORTS_SGL_KERNEL = Feature(
    "<0.5.13",
    "mem_cache/memory_pool_host.py imports sgl_kernel.kvcacheio at module level unless the platform is NPU / XPU / "
    "MPS, and the scheduler imports it; from 0.5.13 only on CUDA / HIP",
)
SAVE_SHARDED_MODEL_TAKES_PARAMS = Feature(
    "<0.5.13",
    "the scheduler's save_sharded_model(self, params) takes one dict while its RPC handler calls it with the "
    "Engine's keywords, so Engine.save_sharded_model(path=...) fails; it has to be save_sharded_model(params={...}) "
    "(0.5.13 adds Scheduler.save_sharded_model(**kwargs))",
)

# ---- the releases each harness speaks (not a fact of one SGLang function: the harness's tests are the check) -------

#: sandbox/models.py: SGLang's ModelRunner set up as its bench_one_batch sets one up (bootstrap.init_parallel_runtime,
#: runtime_context.publish(role="scheduler", ranks=SpawnRanks)); older releases spell publishing, bootstrap and the
#: runner differently and raise NotImplementedError naming the release
MODEL_RUNNER_RELEASES = SpecifierSet(">=0.5.21")
#: sandbox/engine.py: sglang.Engine(device="cpu") started, generating, updated from disk and from tensors (in a
#: begin/end session where the release has them: UPDATE_SESSIONS) and read back (save_sharded_model) through its
#: public API; tests/test_engine_smoke.py proves it on each release
ENGINE_RELEASES = SpecifierSet(">=0.5.11")
#: sandbox/rl_loop.py and what runs it — the demo, the README's CPU recipe, the Engine and HTTP-server suites: the
#: whole RL loop (0.5.23's weight-update sessions, the weight-checker request and its checksum action, a fresh
#: ModelRunner load as the reference, the HTTP server's weight versions per token span)
RL_LOOP_RELEASES = SpecifierSet(">=0.5.23")


def all_features() -> dict[str, Feature]:
    return {name: f for name, f in globals().items() if isinstance(f, Feature)}


__all__ = ["ENGINE_RELEASES", "MODEL_RUNNER_RELEASES", "RL_LOOP_RELEASES", "all_features", *all_features()]
