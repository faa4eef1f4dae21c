"""What the test fixtures know about SGLang releases (tests/support/sglang_runtime.py): named flags like
compat/features.py (the product's) and sandbox/releases.py (the CPU sandbox's), checked against the
installed SGLang's code by tests/test_compat_features.py."""

from __future__ import annotations

from sglang_trtllm_moe.compat.features import Feature

WEIGHT_CACHE_CHECK = Feature(
    ">=0.5.17,<0.5.20",
    "WeightUpdater refuses updates unless the runner's --weight-cache-mode is 'off', read through "
    "get_model_runner().server_args (0.5.20+ reads runtime_context.get_model().weight_cache_mode instead)",
)
WEIGHT_CHECKER_TAKES_PS = Feature(
    ">=0.5.16,<0.5.21",
    "WeightChecker takes the runner's ParallelState, handle() has no role=, and _snapshot aliases CPU tensors",
)
TOPK_REMAPS_OFF_GPU = Feature(
    ">=0.5.23",
    "select_experts maps top-k ids from logical to physical experts (EPLB / redundant experts) on every platform; "
    "before, layers/moe/topk.py `_post_process_topk_ids` remaps only under `if _is_cuda:` / `elif _is_hip:`, so "
    "on a CPU box the MoE layers get logical ids as slot indices (a GPU server remaps): tests/test_eplb.py checks "
    "what is served after a rebalance only where the remap runs",
)
SPAWN_RANKS = Feature(">=0.5.21", "runtime_context.SpawnRanks carries per-rank placement for multi-process worlds")


def all_features() -> dict[str, Feature]:
    return {name: f for name, f in globals().items() if isinstance(f, Feature)}
