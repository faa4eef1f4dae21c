"""The test-only CPU sandbox (sandbox/activation.py, sandbox/standins.py), an extension of the plugin registered in
its own entry-point group (sandbox/extension.py): with SGLANG_TRTLLM_MOE_EMULATE=1 and
SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100 in the environment, the plugin's own `register()` — which SGLang's
`load_plugins()` runs first in every process it starts — lets the extension make the process see an SM100 GPU and
apply the CPU stand-ins (`process_setup`); nothing of the harness on PYTHONPATH. Without both switches nothing of
it happens (a normal process pays nothing: no torch import from it; tests/test_standins.py checks no stand-in is
active then), and a wrong value is refused with a message that names the fix.

A plain `sglang.Engine(device="cpu", ...)` script with the two switches serves through the plugin's path (its
decision line and "prepared in place" lines in SGLang's log); the HTTP server's recipe: tests/test_http_server.py.
"""

from __future__ import annotations

import pytest

from sglang_trtllm_moe.sandbox.releases import ENGINE_RELEASES

from .support.helpers import last_json, run_python

PROBE = """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import torch
    from sglang_trtllm_moe.builtins.selection_hooks import device_from_sglang
    from sglang_trtllm_moe.plugin import state
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16)
        torch.mm(a, a, out_dtype=torch.float32)
        mm = True
    except Exception:
        mm = False
    st = state()
    print(json.dumps({"status": st.status, "sandbox": st.set_up.get("sandbox", ""), "errors": st.errors, "mm_dtype": mm,
                      "vllm_stub": "vllm._custom_ops" in sys.modules, "sm": device_from_sglang().sm}))
"""

SWITCHES = {"SGLANG_TRTLLM_MOE_EMULATE": "1", "SGLANG_TRTLLM_MOE_TEST_FAKE_SM": "100"}


def test_the_two_switches_activate_the_sandbox_through_sglang_load_plugins():
    got = last_json(run_python(PROBE, env=SWITCHES))
    assert got["status"] == "enabled" and not got["errors"], got
    assert got["sm"] == 100, got  # SGLang's own platform facts say SM100
    assert got["mm_dtype"] and got["vllm_stub"], got  # the stand-ins are in place
    assert "test-only CPU sandbox: SGLang sees an SM100 GPU" in got["sandbox"], got


def test_fake_sm_without_the_emulator_is_off_and_says_why():
    got = last_json(run_python(PROBE, env={"SGLANG_TRTLLM_MOE_TEST_FAKE_SM": "100"}))
    assert got["sandbox"] == "" and got["sm"] is None and not got["mm_dtype"], got
    assert any("without SGLANG_TRTLLM_MOE_EMULATE=1" in e and "set both" in e for e in got["errors"]), got


def test_an_sm_the_sandbox_cannot_fake_is_refused_with_the_fix():
    got = last_json(run_python(PROBE, env={**SWITCHES, "SGLANG_TRTLLM_MOE_TEST_FAKE_SM": "90"}))
    assert got["status"] == "enabled" and got["sandbox"] == "" and got["sm"] is None, got
    assert any(
        "SGLANG_TRTLLM_MOE_TEST_FAKE_SM=90" in e and "set SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100" in e
        for e in got["errors"]
    ), got


def test_register_without_the_switches_imports_neither_torch_nor_sglang_layers():
    """Start-up stays free: the extension's set-up reads the switch from the environment before anything of the
    sandbox is imported, and the extension is the sandbox's entry point in the plugin's own group."""
    code = """
        import importlib.metadata, json, sys
        ep = [e for e in importlib.metadata.entry_points(group="sglang_trtllm_moe") if e.name == "sandbox"]
        done = ep[0].load().process_setup(release=None)
        print(json.dumps({"done": done, "torch": "torch" in sys.modules,
                          "topk": "sglang.srt.layers.moe.topk" in sys.modules}))
    """
    assert last_json(run_python(code)) == {"done": None, "torch": False, "topk": False}


ENGINE = """
    import json
    import sglang

    if __name__ == "__main__":
        engine = sglang.Engine(model_path=MODEL, device="cpu", attention_backend="torch_native",
                               bf16_gemm_backend="torch", max_total_tokens=2048, log_level="info")
        try:
            out = engine.generate(input_ids=[[5, 17, 42, 99]], sampling_params={"temperature": 0, "max_new_tokens": 3})
            print(json.dumps({"tokens": out[0]["output_ids"]}))
        finally:
            engine.shutdown()
"""


@pytest.mark.sglang(str(ENGINE_RELEASES), reason="sglang.Engine's CPU spawn flow (sandbox/releases.py ENGINE_RELEASES)")
def test_a_plain_sglang_engine_serves_through_the_plugin(tmp_path):
    pytest.importorskip("xgrammar", reason="sglang.Engine's detokenizer imports xgrammar (ci/releases.tsv pin)")
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="qwen3_moe", quant="nvfp4"))
    script = tmp_path / "engine.py"
    script.write_text(ENGINE.replace("MODEL", repr(model)))
    proc = run_python(script.read_text(), env={**SWITCHES, "OMP_NUM_THREADS": "1"}, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert len(last_json(proc)["tokens"]) == 3
    assert "moe_runner_backend=flashinfer_trtllm" in log, log[-4000:]  # the plugin's decision line (launcher)
    # the scheduler built the model through the plugin: every MoE layer prepared in place for the TRT-LLM kernels
    assert log.count("nvfp4 prepared in place for flashinfer_trtllm") == 2, log[-4000:]
