"""`sglang-trtllm-moe demo`: the plugin's whole job on real SGLang objects, on a CPU-only machine, in minutes.

Each step prints as it runs and records a check; the summary table at the end lists them, and the exit code is 0
only when every check passed. The steps use SGLang's own machinery (entry-point plugin loading, ServerArgs
resolution, FusedMoE + ModelOpt NVFP4, the safetensors loader, WeightUpdater, WeightChecker) with the kernels
replaced by the plugin's emulator (SGLANG_TRTLLM_MOE_EMULATE=1), since there is no Blackwell GPU here.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass

SPEC_KW = dict(num_experts=8, hidden=256, intermediate=96, top_k=2)


@dataclass
class Check:
    step: str
    ok: bool
    detail: str
    seconds: float


class Demo:
    def __init__(self, out=sys.stdout):
        self.out = out
        self.checks: list[Check] = []
        self._t = time.perf_counter()

    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def check(self, step: str, ok: bool, detail: str) -> bool:
        now = time.perf_counter()
        self.checks.append(Check(step, bool(ok), detail, now - self._t))
        self._t = now
        self.say(f"  [{'PASS' if ok else 'FAIL'}] {step}: {detail}")
        return bool(ok)

    def summary(self) -> int:
        w = max(len(c.step) for c in self.checks)
        self.say("\nsummary")
        self.say(f"  {'step':<{w}}  result  seconds  detail")
        for c in self.checks:
            self.say(f"  {c.step:<{w}}  {'pass' if c.ok else 'FAIL':<6}  {c.seconds:7.1f}  {c.detail}")
        failed = [c for c in self.checks if not c.ok]
        self.say(f"\n{len(self.checks) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0


def _bytes_equal(a, b) -> bool:
    import torch

    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def run(out=sys.stdout) -> int:
    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"
    d = Demo(out)
    work = tempfile.mkdtemp(prefix="sglang-trtllm-moe-demo-")

    d.say("1/7 SGLang loads the plugin through its entry points")
    from sglang.srt.plugins import load_plugins

    from .. import doctor

    load_plugins()
    r = doctor.report(load=False, import_targets=True)
    states = [t["state"] for t in r["targets"]]
    d.check("plugin loaded by SGLang", r["enabled"] and "missing" not in states,
            f"sglang {r['sglang_version']}, {states.count('landed')} hook targets landed, "
            f"{states.count('missing')} missing, {states.count('not_applicable')} not applicable")

    import torch

    from .. import layer_state
    from . import layers as cpu_layers, reference

    spec = cpu_layers.MoeSpec(**SPEC_KW)
    model_dir = os.path.join(work, "ckpt-a")
    ck_a = cpu_layers.random_nvfp4_checkpoint(spec, seed=0)
    cpu_layers.write_safetensors_checkpoint(model_dir, ck_a, spec)

    d.say("2/7 explain: which MoE backend a DeepSeek-style NVFP4 model gets on SM100, and why")
    try:
        from ..explain import explain_model

        rep = explain_model(model_dir, sm=100)
        rejected = [c for c in rep.get("candidates", []) if not c.get("eligible")]
        d.check("explain on faked SM100", rep.get("winner") in ("flashinfer_trtllm", "flashinfer_trtllm_routed"),
                f"winner {rep.get('winner')} ({rep.get('code')}); {len(rejected)} candidate(s) rejected with reasons")
    except Exception as e:  # noqa: BLE001
        d.check("explain on faked SM100", False, f"{type(e).__name__}: {e}")

    d.say("3/7 a FusedMoE NVFP4 layer, loaded from a safetensors checkpoint, prepared in place")
    from .runtime import init_single_process

    init_single_process("flashinfer_trtllm")
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    model = cpu_layers.TinyMoeModel(spec)
    layer = model.experts
    model.load_weights(safetensors_weights_iterator([os.path.join(model_dir, "model.safetensors")]))
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    st = layer_state.state_of(layer)
    kept = all(p.data_ptr() == ptrs[n] for n, p in model.named_parameters() if n in ptrs)
    d.check("prepared in place", st is not None and st.clean and kept,
            f"{st.experts_prepared_total if st else 0} expert groups in TRT-LLM layout, every data_ptr kept: {kept}")

    d.say("4/7 a forward through SGLang's FusedMoE runs the emulator on the prepared bytes")
    from sglang.srt.layers.moe.topk import TopK

    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, spec.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(16, spec.num_experts, generator=g)

    def forward():
        topk = TopK(top_k=spec.top_k, renormalize=True, layer_id=0)(x, logits)
        return layer(x, topk).float(), topk

    y, topk = forward()
    tight = reference.moe(x, topk.topk_ids, topk.topk_weights, ck_a, spec, quantize_like_kernel=True)
    plain = reference.moe(x, topk.topk_ids, topk.topk_weights, ck_a, spec)
    rel_t = float((y - tight).norm() / tight.norm())
    rel_p = float((y - plain).norm() / plain.norm())
    d.check("emulated forward vs dequantized reference", rel_t < 0.02 and rel_p < 0.35,
            f"relative error {rel_t:.4f} against a reference rounding where the kernel rounds (bound 0.02), "
            f"{rel_p:.3f} against float activations (bound 0.35: two NVFP4 roundings of ~10 % RMS each)")

    d.say("5/7 RL: update from a second checkpoint on disk, then a one-expert update from tensors")
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    def updater(path):
        return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=ModelConfig(model_path=path),
                             custom_weight_loaders={}, get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                             recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)

    ck_b = cpu_layers.random_nvfp4_checkpoint(spec, seed=1)
    dir_b = os.path.join(work, "ckpt-b")
    cpu_layers.write_safetensors_checkpoint(dir_b, ck_b, spec)
    ok, msg = updater(dir_b).update_weights_from_disk(dir_b, "auto")
    ck_c = {k: v for k, v in cpu_layers.random_nvfp4_checkpoint(spec, seed=2).items() if k.startswith("experts.3.")}
    before = st.experts_prepared_total
    ok2, msg2 = updater(model_dir).update_weights_from_tensor(list(cpu_layers.checkpoint_names(ck_c).items()))
    intended = dict(ck_b, **ck_c)
    fresh = cpu_layers.TinyMoeModel(spec)
    fresh.load_weights(cpu_layers.checkpoint_names(intended).items())
    fresh.experts.quant_method.process_weights_after_loading(fresh.experts)
    same = all(_bytes_equal(getattr(layer, n), getattr(fresh.experts, n))
               for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"))
    kept = all(p.data_ptr() == ptrs[n] for n, p in model.named_parameters() if n in ptrs)
    d.check("updates bit-exact and storage-stable", ok and ok2 and same and kept,
            f"disk: {msg}; tensor: {msg2}; equals a fresh load: {same}; every data_ptr kept: {kept}; "
            f"one-expert update prepared {st.experts_prepared_total - before} expert groups")

    d.say("6/7 SGLang's WeightChecker: snapshot, reset, the same updates again, compare")
    from .runtime import weight_checker

    wc = weight_checker(model)  # SGLang's WeightChecker, built as this release's ModelRunner builds it

    def replay(tensors_c):
        updater(dir_b).update_weights_from_disk(dir_b, "auto")
        updater(model_dir).update_weights_from_tensor(list(cpu_layers.checkpoint_names(tensors_c).items()))

    wc.handle("snapshot", role="target")
    wc.handle("reset_tensors", role="target")
    replay(ck_c)
    try:
        wc.handle("compare", role="target")
        d.check("weight checker after a correct update", True,
                "SGLang's WeightChecker (plugin comparator for the TRT-LLM layouts) found every byte as snapshotted")
    except Exception as e:  # noqa: BLE001
        d.check("weight checker after a correct update", False, f"{type(e).__name__}: {str(e)[:300]}")

    d.say("7/7 a corrupted update is caught")
    bad = dict(ck_c)
    bad["experts.3.gate_proj.weight"] = bad["experts.3.gate_proj.weight"].float()  # wrong dtype for packed FP4
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        updater(model_dir).update_weights_from_tensor(list(cpu_layers.checkpoint_names(bad).items()))
        refused = False
        detail = "the update was accepted"
    except ValueError as e:
        refused = True
        detail = str(e).split(";")[0]
    untouched = all(_bytes_equal(p, snap[n]) for n, p in model.named_parameters())
    d.check("bad update refused before any byte changed", refused and untouched, f"{detail}; weights untouched: {untouched}")

    flipped = dict(ck_c)
    w = flipped["experts.3.gate_proj.weight"].clone()
    w[41, 7] ^= 0x30  # well-formed bytes, wrong values: only a comparison can catch this
    flipped["experts.3.gate_proj.weight"] = w
    wc.handle("snapshot", role="target")
    wc.handle("reset_tensors", role="target")
    replay(flipped)
    try:
        wc.handle("compare", role="target")
        d.check("corrupted update caught by the weight checker", False, "the comparison passed")
    except Exception as e:  # noqa: BLE001 - SGLang raises on a mismatch
        msg = str(e)
        located = "expert 3" in msg
        d.check("corrupted update caught by the weight checker", located,
                "mismatch located: " + (msg[msg.find("w13_weight["):][:90] if "w13_weight[" in msg else msg[:200]))
    return d.summary()
