"""NVFP4 FusedMoE layers of the installed SGLang on CPU, prepared by the plugin, against SGLang's own preparation.
The scenarios every format shares (updates, refusals, the checker, threads, ...): tests/test_layer_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_trtllm_moe import layer_state
from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import layers as cpu_layers

from .support import sglang_runtime

WEIGHTS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SCALARS = ("g1_alphas", "g1_alphas_up", "g2_alphas", "w13_input_scale_quant", "w2_input_scale_quant", "g1_scale_c")

CASES = [
    pytest.param(cpu_layers.MoeSpec(intermediate=128), id="gated-I128"),
    pytest.param(cpu_layers.MoeSpec(intermediate=96), id="gated-I96-padded"),
    pytest.param(cpu_layers.MoeSpec(intermediate=128, activation="relu2", gated=False), id="relu2-I128"),
    # NVFP4 needs I % 16 == 0 (one e4m3 scale per 16 inputs of w2), so the padded non-gated case is I = 208 -> 256.
    pytest.param(cpu_layers.MoeSpec(intermediate=208, activation="relu2", gated=False), id="relu2-I208-padded"),
]


@pytest.fixture(scope="module", autouse=True)
def runtime():
    sglang_runtime.ensure("flashinfer_trtllm")


def loaded_layer(spec, seed=0):
    layer = cpu_layers.build_layer(spec)
    cpu_layers.load_checkpoint(layer, cpu_layers.random_nvfp4_checkpoint(spec, seed=seed), spec.num_experts)
    return layer


@pytest.mark.parametrize("spec", CASES)
def test_prepared_bytes_equal_sglang_own_preparation(spec, monkeypatch):
    # in place (same Parameter objects, storage, shapes) and byte-equal to SGLang's own preparation
    ours, upstream = sglang_runtime.prepared_like_sglang(lambda: loaded_layer(spec), WEIGHTS, monkeypatch)
    st = layer_state.state_of(ours)
    assert st is not None and st.clean, "the plugin did not take over preparation"
    # <= 0.5.22 SGLang stores the per-tensor w13 scales [Up, Gate] for trtllm and then reads them as [Gate, Up]:
    # its gate/up alphas are swapped; the plugin reads them as stored (formats/nvfp4.w13_scales_up_first).
    swapped = spec.gated and features.NVFP4_W13_SCALE_2_UP_GATE.present()
    if not hasattr(upstream, "g1_alphas_up"):
        # SGLang < 0.5.14 keeps one GEMM1 alpha, from column 0 of w13_weight_scale_2 (it warns when the columns
        # differ); the other column's alpha by SGLang 0.5.14's own formula (_compute_gemm1_alphas), on this
        # release's input scale: (max w13_input_scale) * w13_weight_scale_2[:, 1]
        s2 = upstream.w13_weight_scale_2.data
        other = s2[:, 1] if spec.gated and s2.dim() == 2 and s2.shape[1] >= 2 else s2.reshape(s2.shape[0])
        upstream.g1_alphas_up = (upstream.w13_input_scale.data.max().to(torch.float32) * other).to(torch.float32)
    expected = {n: getattr(upstream, n).data for n in SCALARS}
    if swapped:
        expected["g1_alphas"], expected["g1_alphas_up"] = expected["g1_alphas_up"], expected["g1_alphas"]
        expected["g1_scale_c"] = (upstream.w2_input_scale_quant.data * upstream.g1_alphas.data).to(torch.float32)
    for n in SCALARS:
        torch.testing.assert_close(getattr(ours, n).data, expected[n], rtol=0, atol=0, msg=n)


def test_padded_gate_half_starts_at_padded_row():
    # I = 96 gated: SGLang allocates 2 * 128 rows; gate (w1) must sit at row 128, not 96, in checkpoint layout.
    spec = cpu_layers.MoeSpec(intermediate=96)
    layer = loaded_layer(spec)
    ck = cpu_layers.random_nvfp4_checkpoint(spec)
    w = layer.w13_weight.data
    assert torch.equal(w[0, :96], ck["experts.0.up_proj.weight"])
    assert torch.equal(w[0, 128:224], ck["experts.0.gate_proj.weight"])


_forward = sglang_runtime.forward


@pytest.mark.parametrize("spec", CASES)
def test_forward_through_sglang_layer_with_emulator_matches_dequantized_reference(spec, monkeypatch):
    from .support.moe_reference import reference_moe

    monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    layer = loaded_layer(spec)
    layer.quant_method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g)
    out, topk = _forward(layer, x, logits)
    ck = cpu_layers.random_nvfp4_checkpoint(spec)
    ref = reference_moe(x, topk.topk_ids, topk.topk_weights, ck, spec)
    tight = reference_moe(x, topk.topk_ids, topk.topk_weights, ck, spec, round_like_kernel=True)
    # The kernel rounds the activations and the GEMM1 output to NVFP4 (e2m1 has 1 mantissa bit: ~10 % RMS per
    # rounding), so against a float reference the output agrees to ~20 % (bound 0.35); against a reference that
    # rounds at the same two points, only accumulation order and 1-ulp reciprocal differences remain (bound 0.02).
    # A wrong layout (rows of another half or expert) gives ~100 %.
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.35, float(rel)
    rel_tight = (out.float() - tight).norm() / tight.norm()
    assert rel_tight < 0.02, float(rel_tight)

    # The same check must fail when the bytes are not in kernel layout (proves the bound can catch a layout bug).
    NVFP4 = layer_state.state_of(layer).fmt
    NVFP4.unprepare_(layer, "w13", list(range(spec.num_experts)))
    bad, _ = _forward(layer, x, logits)
    assert (bad.float() - ref).norm() / ref.norm() > 0.5


# ---- a global `auto`: SGLang runs NVFP4 on flashinfer_trtllm, the weights must be laid out for it -----------------

AUTO_SCRIPT = """
    import hashlib, json, os
    import torch
    import tests.conftest  # noqa: F401  (torchvision shim)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_trtllm_moe.sandbox.runtime import init_single_process
    init_single_process("auto")
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.sandbox import layers as L
    from tests.support import sglang_runtime
    from tests.support.moe_reference import reference_moe

    out = {}
    spec = L.MoeSpec(intermediate=128)
    layer = L.build_layer(spec)
    out["runner"] = str(layer.quant_method._moe_runner_backend.value)
    ptrs = {n: p.data_ptr() for n, p in layer.named_parameters()}
    ck = L.random_nvfp4_checkpoint(spec, seed=0)
    L.load_checkpoint(layer, ck, spec.num_experts)
    layer.quant_method.process_weights_after_loading(layer)
    out["managed"] = layer_state.state_of(layer) is not None
    out["storage_kept"] = all(getattr(layer, n).data_ptr() == ptrs[n]
                              for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"))
    def sha(t):
        return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    out["bytes"] = {n: sha(getattr(layer, n).data) for n in json.loads(os.environ["NAMES"])}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, spec.num_experts, generator=g)
    try:
        y, topk = sglang_runtime.forward(layer, x, logits)
        ref = reference_moe(x, topk.topk_ids, topk.topk_weights, ck, spec, round_like_kernel=True)
        out["rel_err"] = float((y.float() - ref).norm() / ref.norm())
    except Exception as e:
        out["forward_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        L.build_layer(L.MoeSpec(intermediate=96))
        out["unpadded"] = "built"
    except Exception as e:
        out["unpadded"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
"""
AUTO_NAMES = (
    "w13_weight",
    "w13_weight_scale",
    "w2_weight",
    "w2_weight_scale",
    "g1_alphas",
    "g1_alphas_up",
    "g2_alphas",
    "g1_scale_c",
    "w13_input_scale_quant",
    "w2_input_scale_quant",
)


@pytest.mark.sglang(
    features.NVFP4_AUTO_RUNNER_MISMATCH.releases,
    reason="SGLang's NVFP4 runner/layout mismatch on a global auto exists from 0.5.16; before, its "
    "apply falls back to sgl-kernel's cutlass_moe_fp4, consistent with the CUTLASS weight layout",
)
def test_global_auto_is_laid_out_for_the_runner_sglang_resolves():
    """SGLang's own bug (0.5.16-0.5.20 NotImplementedError, 0.5.21+ AttributeError g1_scale_c at the first forward):
    with --moe-runner-backend auto on Blackwell (no rule for the model, SGLANG_TRTLLM_MOE_AUTO=0, ...), the NVFP4
    method runs flashinfer_trtllm but its weights were laid out for CUTLASS. With the plugin the layer is laid out
    for the runner SGLang resolved, in place: the same bytes as an explicit flashinfer_trtllm layer, a forward that
    matches the reference; a layer whose intermediate size is not padded for that kernel fails at construction,
    naming the layer, the size and the fix. In its own process (the backend is chosen once per process)."""
    import json

    from .support.helpers import last_json, run_python
    from .support.moe_reference import reference_moe  # noqa: F401  (imported by the script)

    proc = run_python(AUTO_SCRIPT, env={"SGLANG_TRTLLM_MOE_EMULATE": "1", "NAMES": json.dumps(AUTO_NAMES)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc)
    assert got["runner"] == "flashinfer_trtllm", got  # SGLang's own choice, not the plugin's
    assert "forward_error" not in got, got["forward_error"]
    assert got["managed"] and got["storage_kept"], got
    assert got["rel_err"] < 0.02, got["rel_err"]  # the same bound as an explicit layer (rounded like the kernel)
    explicit = loaded_layer(cpu_layers.MoeSpec(intermediate=128), seed=0)  # this module runs flashinfer_trtllm
    explicit.quant_method.process_weights_after_loading(explicit)
    for n in AUTO_NAMES:
        import hashlib

        want = hashlib.sha256(
            getattr(explicit, n).data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        assert got["bytes"][n] == want, f"{n} differs from an explicit flashinfer_trtllm layer"
    msg = got["unpadded"]
    assert msg.startswith("TrtllmLayerError") and "intermediate size per rank 96" in msg and "Fix:" in msg, msg
