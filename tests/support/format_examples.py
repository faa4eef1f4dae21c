"""A checkpoint config of each registered format, from the sandbox's example of it (sandbox/format_examples.py
`EXAMPLES`): what the registry tests detect a format from and build its layer kind with, so that a new format is not
listed again in them."""

from __future__ import annotations

from sglang_trtllm_moe.formats import Checkpoint, WeightFormat
from sglang_trtllm_moe.sandbox.format_examples import example_of
from sglang_trtllm_moe.selection import problem_from_hf_config


def hf_config(fmt: WeightFormat) -> dict:
    """A tiny Qwen3-MoE config.json whose `quantization_config` is the format's example (none when it is empty:
    an unquantized checkpoint)."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
    }
    if example_of(fmt).quantization_config:
        cfg["quantization_config"] = dict(example_of(fmt).quantization_config)
    return cfg


def checkpoint(fmt: WeightFormat) -> Checkpoint:
    """What selection reads from the example's config (as SGLang names the quantization)."""
    problem = problem_from_hf_config(hf_config(fmt), quantization=example_of(fmt).quantization)
    assert problem is not None, fmt.name
    return problem.checkpoint
