"""Selection and explain for the MX paths (no SGLang needed): MXFP8 on flashinfer_trtllm(_routed); MXFP4 experts
on an FP8 config and gpt-oss MXFP4 on flashinfer_mxfp4 (reported, never auto-switched to); online MXFP8 and
Kimi-K3's SiTU left to SGLang with the reason."""

from __future__ import annotations

import json

import pytest

from sglang_trtllm_moe.selection import Code, DeviceInfo, problem_from_hf_config, resolve

B200 = DeviceInfo(sm=100, flashinfer_version="0.7.2", source="test")


def config(arch, quant=None, **extra):
    cfg = {
        "architectures": [arch],
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "hidden_act": "silu",
        **extra,
    }
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


MXFP8 = config("DeepseekV3ForCausalLM", {"quant_method": "mxfp8", "activation_scheme": "dynamic"})
DSV4 = config(
    "DeepseekV4ForCausalLM", {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
)
MIMO = config(
    "MiMoV2ForCausalLM",
    {"quant_method": "fp8", "weight_block_size": [128, 128], "routed_experts_quant_method": "mxfp4"},
)
GPTOSS = config(
    "GptOssForCausalLM", {"quant_method": "mxfp4"}, num_local_experts=32, hidden_size=2880, intermediate_size=2880
)


def test_mxfp8_checkpoint_is_served_on_both_trtllm_backends_and_sglang_choice_agrees():
    p = problem_from_hf_config(MXFP8)
    fmt, _ = p.weight_format()
    assert fmt.name == "mxfp8"
    res = resolve(p, B200, upstream="flashinfer_trtllm")
    assert res.code == Code.UPSTREAM_AGREES and res.winner == "flashinfer_trtllm"
    assert all(c.eligible for c in res.candidates)


def test_online_mxfp8_is_left_to_sglang_with_the_reason():
    p = problem_from_hf_config(config("DeepseekV3ForCausalLM"), quantization="mxfp8")
    assert p.online_quantization and p.weight_format()[0] is None
    res = resolve(p, B200, upstream="flashinfer_trtllm")
    assert res.winner == "flashinfer_trtllm" and res.code == Code.NO_ELIGIBLE_BACKEND
    assert "online MXFP8" in res.reason and "SGLang's own preparation" in res.reason


@pytest.mark.parametrize(
    "cfg,fmt_name",
    [(DSV4, "mxfp4_experts"), (MIMO, "mxfp4_experts"), (GPTOSS, "mxfp4_gptoss")],
    ids=["deepseek-v4", "mimo-v2", "gpt-oss"],
)
def test_mxfp4_layers_are_reported_on_flashinfer_mxfp4_and_never_auto_switched(cfg, fmt_name):
    p = problem_from_hf_config(cfg)
    fmt, _ = p.weight_format()
    assert fmt.name == fmt_name and fmt.own_backend == "flashinfer_mxfp4"
    kept = resolve(p, B200, upstream="flashinfer_mxfp4")  # SGLang's model override (gpt-oss, DeepSeek-V4 0.5.19+)
    assert kept.winner == "flashinfer_mxfp4" and kept.code == Code.UPSTREAM_MODEL_RULE
    assert "the plugin prepares in place" in kept.reason
    alone = resolve(p, B200, upstream="auto")  # no TRT-LLM runner can take it: SGLang decides, as upstream
    assert alone.winner == "auto" and alone.code == Code.NO_ELIGIBLE_BACKEND
    assert all(c.code == Code.QUANT_UNSUPPORTED_BY_BACKEND and "flashinfer_mxfp4" in c.reason for c in alone.candidates)


def test_kimi_k3_situ_is_not_the_gpt_oss_format():
    from sglang_trtllm_moe.formats import MXFP4_GPTOSS

    assert MXFP4_GPTOSS.activation_problem("situ", True) is not None
    assert MXFP4_GPTOSS.activation_problem("silu", True) is None


def test_explain_names_the_format_and_the_backends_the_plugin_prepares(tmp_path):
    from sglang_trtllm_moe.explain import explain_model

    out = {}
    for name, cfg in (("mxfp8", MXFP8), ("dsv4", DSV4), ("gptoss", GPTOSS)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = explain_model(str(d), sm=100, run_sglang=False)["plugin_prepares"]
    assert out["mxfp8"]["backends"] == ["flashinfer_trtllm", "flashinfer_trtllm_routed"]
    assert out["dsv4"]["backends"] == ["flashinfer_mxfp4"] and out["dsv4"]["format"] == "mxfp4_experts"
    assert out["gptoss"]["backends"] == ["flashinfer_mxfp4"] and "in place" in out["gptoss"]["reason"]
