"""One model through a real `sglang.Engine` on a GPU with CUDA graphs on, the plugin's path (emulated kernels on a
faked SM100), every RL step an RL framework takes; a report of checks tests/gpu/test_engine_graphs.py asserts.

    python -m tests.gpu.engine_run qwen3_moe:nvfp4 [--cpu]    # one model, prints the JSON report

`--cpu`: the same flow on a CPU (SGLang 0.5.23's CPU sandbox Engine, no graphs): a dry run of the test logic.

The flow, per model (checkpoints A, B and P = two experts of the last MoE layer from a third seed):
* engine G, CUDA graphs for decode batches 1-4 (prefill eager), --enable-return-routed-experts, on A: greedy
  tokens of a 4-prompt batch (graph bs 4) and of one prompt (graph bs 1); the served state read back
  (`save_sharded_model`);
* update_weights_from_disk(B), then (A): tokens and every served byte back to A's exactly — the update landed in the
  graphs captured at start-up, and a second one restores;
* update_weights_from_tensor(B) with CUDA tensors in 3 buckets (in a begin / end session where the release has them):
  state and tokens equal the disk update's;
* a refused bucket (a NaN per-tensor scale, or for BF16 a weight one column too wide): (False, "refused ..."),
  nothing changed;
* a partial update (P, CUDA tensors): now serving B+P — tokens, state, routed experts (R3) recorded;
* the weight checker: snapshot, reset_tensors, replay B+P from disk, compare passes;
* engine E, eager (no CUDA graphs), a fresh load of B+P: its tokens, served bytes and routed experts equal G's after
  its updates (graphs = eager, update = fresh load), routed experts not all zero;
* NVFP4 Qwen3-MoE only, engine S: CUDA graphs and the memory saver (enable_memory_saver, as colocated verl / slime
  run): on A, release_memory_occupation, resume_memory_occupation, a full update to B+P from disk: tokens and state
  equal E's.
SGLang's own update_weights_from_disk recaptures no graph unless asked (`recapture_cuda_graph=False`): tokens after
an update equal to a fresh eager load are what proves the captured graphs read the updated storage.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time
import traceback

PROMPTS = [[5, 17, 42, 99], [5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]
NEW_TOKENS = 6


#: attention backends per architecture on the GPU: SGLang refuses triton for Nemotron-H ("the first layer might not
#: be an attention layer", server_args.py); FA3's library is not carried (ci/gpu-wheels), so flashinfer's (its JIT
#: compiles the kernels on first use)
ATTENTION = {"nemotron_h": "flashinfer"}
#: the checkpoint's shape per architecture on the GPU: DeepSeek's MLA with a KV LoRA width of 256 (latent + rope
#: 288: SGLang's triton MLA decode kernel takes 576 or 288 only; the CPU sandbox's 128 fails to compile there)
SPEC = {"deepseek_v3": {"kv_lora": 256}}
#: extra engine arguments per architecture on the GPU: the tiny Nemotron-H has no Mamba layer, and SGLang 0.5.17's
#: memory-pool sizing divides by the Mamba cache per request (`_handle_max_mamba_cache`: assert stage_per_req > 0)
#: unless the Mamba pool size is given
#: Its prefill runs on triton: on the faked SM100 SGLang's flashinfer backend builds its ragged prefill wrapper with
#: the CUTLASS FMHA (`is_sm100_supported()`), which flashinfer refuses on the H200 (SM100a only); decode stays on
#: flashinfer (SGLang refuses triton as the attention backend of Nemotron-H)
ENGINE = {
    "nemotron_h": {
        "max_mamba_cache_size": 16,
        "prefill_attention_backend": "triton",
        "decode_attention_backend": "flashinfer",
    }
}


def _engine_args(cpu: bool, graphs: bool, arch: str = "", **extra) -> dict:
    if cpu:  # the CPU sandbox's flags (sandbox.models.DEFAULT_SERVER_ARGS), no graphs on a CPU
        from sglang_trtllm_moe.sandbox import models

        kw = {**models.DEFAULT_SERVER_ARGS, **models.ROUTED_EXPERTS_ARGS}
    else:
        kw = dict(
            **ENGINE.get(arch, {}),
            attention_backend=ATTENTION.get(arch, "triton"),
            sampling_backend="pytorch",
            # left on auto, a faked SM100 picks the CuTe-DSL BF16 GEMM (No module named 'cutlass')
            bf16_gemm_backend="torch",
            moe_runner_backend="auto",
            mem_fraction_static=0.2,
            max_total_tokens=8192,
            random_seed=0,
            disable_prefill_cuda_graph=True,
            cuda_graph_max_bs_decode=4,
            disable_cuda_graph=not graphs,
            enable_return_routed_experts=True,
            # Nemotron-H: no Mamba-cache snapshots for the radix tree (a faked SM100 would promise them)
            disable_radix_cache=True,
            log_level="warning",
        )
    kw.update(extra)
    return kw


class Engine:
    """sglang.Engine through its public API (skip_tokenizer_init: token ids in and out)."""

    def __init__(self, model_dir: str, work: str, **kw):
        import sglang

        self.work = work
        self.engine = sglang.Engine(model_path=model_dir, skip_tokenizer_init=True, **kw)
        self._n = 0

    def shutdown(self) -> None:
        self.engine.shutdown()

    def generate(self, prompts, n=NEW_TOKENS, routed=False):
        out = self.engine.generate(
            input_ids=[list(p) for p in prompts],
            sampling_params={"temperature": 0, "max_new_tokens": n},
            return_routed_experts=routed,
        )
        tokens = [list(o["output_ids"]) for o in out]
        if not routed:
            return tokens
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

        return tokens, [extract_routed_experts_from_meta_info(o).tolist() for o in out]

    def state(self) -> dict:
        import torch
        from safetensors.torch import load_file

        self._n += 1
        path = os.path.join(self.work, f"state-{self._n}")
        os.makedirs(path, exist_ok=True)
        self.engine.save_sharded_model(path=path, pattern=None, max_size=None)
        out: dict = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            out.update({k: v.contiguous().reshape(-1).view(torch.uint8) for k, v in load_file(f).items()})
        return out

    def update_from_disk(self, path: str):
        res = self.engine.update_weights_from_disk(path)
        return res[0], res[1]

    @contextlib.contextmanager
    def session(self):
        """A begin / end weight-update session where the release has them (0.5.21+), else nothing."""
        from sglang_trtllm_moe.compat import features

        if not features.UPDATE_SESSIONS.present():
            yield
            return
        self.engine.begin_weight_update()
        try:
            yield
        finally:
            self.engine.end_weight_update()

    def update_from_tensor(self, named):
        res = self.engine.update_weights_from_tensor(list(named))
        return res[0], res[1]

    def check(self, action: str):
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        res = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action=action), None)
        )
        return bool(res[0]), str(res[1])


def differs(a: dict, b: dict) -> list[str]:
    import torch

    if set(a) != set(b):
        return sorted(set(a) ^ set(b))
    return [n for n in a if a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]


def run(arch: str, quant: str, cpu: bool = False, workdir: str | None = None) -> dict:
    import torch

    from sglang_trtllm_moe.sandbox import checkpoints as ck

    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"
    os.environ["SGLANG_TRTLLM_MOE_TEST_FAKE_SM"] = "100"
    if cpu:
        from sglang_trtllm_moe.sandbox import engine as sandbox_engine

        sandbox_engine.prepare_process()
    work = workdir or tempfile.mkdtemp(prefix=f"gpu-{arch}-{quant}-")
    spec = ck.TinySpec(arch, quant, seed=0, **({} if cpu else SPEC.get(arch, {})))
    moe = spec.moe_layers
    srv = spec.server_args()  # an online quant's --quantization (nvfp4_online: a BF16 checkpoint quantized as it loads)
    full = {s: ck.checkpoint(spec.with_seed(s)) for s in (0, 1)}
    part = ck.quantized_experts(spec.with_seed(2), layers=[moe[-1]], experts=[1, 6])
    dirs = {
        "A": ck.write(os.path.join(work, "A"), spec),
        "B": ck.write(os.path.join(work, "B"), spec.with_seed(1)),
        "B+P": ck.write_tensors(os.path.join(work, "B+P"), spec, {**full[1], **part}),
    }
    device = "cpu" if cpu else "cuda"
    rep: dict = {"release": __import__("sglang").__version__, "device": device}
    t0 = time.perf_counter()

    def step(name: str, ok: bool, **detail) -> None:
        rep[name] = {"ok": bool(ok), **detail, "t": round(time.perf_counter() - t0, 1)}

    def on_device(items):
        return [(n, t.to(device)) for n, t in items]

    g = Engine(dirs["A"], os.path.join(work, "G"), **_engine_args(cpu, graphs=True, arch=arch, **srv))
    try:
        step("engine G up", True, graphs=not cpu)
        t_a = g.generate(PROMPTS)
        t_a1 = g.generate(PROMPTS[:1])
        s_a = g.state()
        moe_names = [n for n in s_a if ".experts." in n]
        # one prompt alone runs the bs-1 graph: compared with itself (a replay is deterministic), not with the
        # same prompt inside the 4-prompt batch — a different batch shape rounds differently for models that are
        # not batch-invariant (DeepSeek's MLA: docs/TESTING.md "Exact comparisons"); recorded for information
        again = g.generate(PROMPTS[:1])
        step(
            "load",
            bool(moe_names) and again == t_a1,
            tokens=t_a,
            moe_tensors=len(moe_names),
            bs1_equals_bs4=t_a1[0] == t_a[0],
        )

        ok, msg = g.update_from_disk(dirs["B"])
        t_b = g.generate(PROMPTS)
        s_b = g.state()
        step("disk A->B", ok and t_b != t_a and bool(differs(s_a, s_b)), message=str(msg)[:200], tokens=t_b)
        ok, msg = g.update_from_disk(dirs["A"])
        back = differs(s_a, g.state())
        t_back = g.generate(PROMPTS)
        step("disk B->A exact", ok and not back and t_back == t_a, differs=back[:6], tokens=t_back)

        items = sorted(full[1].items())
        size = -(-len(items) // 3)
        answers = []
        with g.session():
            for i in range(0, len(items), size):
                answers.append(g.update_from_tensor(on_device(items[i : i + size])))
        d = differs(s_b, g.state())
        t = g.generate(PROMPTS)
        step(
            "tensor buckets (CUDA tensors) == disk",
            all(a[0] for a in answers) and not d and t == t_b,
            differs=d[:6],
            answers=[str(a[1])[:120] for a in answers],
        )

        scalar = [n for n, v in sorted(full[1].items()) if n.endswith(("weight_scale_2", "input_scale"))]
        if scalar:
            bad = [(scalar[0], torch.full_like(full[1][scalar[0]], float("nan")))]
        else:  # BF16 (a float32 tensor would be converted, as a load does), INT4 words: one column too many
            name = next(
                n
                for n in sorted(full[1])
                if ".experts." in n and n.endswith(("down_proj.weight", "down_proj.weight_packed"))
            )
            w = full[1][name]
            bad = [(name, torch.cat([w, w[:, :1]], 1))]
        with g.session():
            ans = g.update_from_tensor(on_device(bad))
        d = differs(s_b, g.state())
        step(
            "refused bucket changes nothing",
            not ans[0] and "refused" in str(ans[1]) and not d and g.generate(PROMPTS) == t_b,
            answer=str(ans[1])[:300],
            differs=d[:6],
        )

        with g.session():
            ans = g.update_from_tensor(on_device(sorted(part.items())))
        t_bp, r_bp = g.generate(PROMPTS, routed=True)
        s_bp = g.state()
        step("partial update (CUDA tensors)", ans[0] and bool(differs(s_b, s_bp)), tokens=t_bp)

        ok1 = g.check("snapshot")
        ok2 = g.check("reset_tensors")
        g.update_from_disk(dirs["B+P"])
        ok3 = g.check("compare")
        step("weight checker", ok1[0] and ok2[0] and ok3[0], answers=[ok1[1][:120], ok2[1][:120], ok3[1][:200]])
    finally:
        g.shutdown()

    e = Engine(dirs["B+P"], os.path.join(work, "E"), **_engine_args(cpu, graphs=False, arch=arch, **srv))
    try:
        t_e, r_e = e.generate(PROMPTS, routed=True)
        d = differs(s_bp, e.state())
        step("eager fresh load == graphs after updates (bytes)", not d, differs=d[:6])
        step("eager fresh load == graphs after updates (tokens)", t_e == t_bp, eager=t_e, graphs=t_bp)
        nonzero = any(x != 0 for r in r_e for x in r)
        step("routed experts: graphs == eager, not zeros", r_e == r_bp and nonzero, nonzero=nonzero)
    finally:
        e.shutdown()

    if (arch, quant) == ("qwen3_moe", "nvfp4") and not cpu:
        saver = _engine_args(cpu, graphs=True, arch=arch, enable_memory_saver=True, **srv)
        s = Engine(dirs["A"], os.path.join(work, "S"), **saver)
        try:
            t_sa = s.generate(PROMPTS)
            s.engine.release_memory_occupation()
            s.engine.resume_memory_occupation()
            ok, msg = s.update_from_disk(dirs["B+P"])
            d = differs(s_bp, s.state())
            t_s = s.generate(PROMPTS)
            step(
                "memory saver: release, resume, full update == fresh",
                t_sa == t_a and ok and not d and t_s == t_bp,
                differs=d[:6],
                message=str(msg)[:200],
            )
        finally:
            s.shutdown()
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    return rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", help="ARCH:QUANT")
    p.add_argument("--cpu", action="store_true", help="a dry run on a CPU (SGLang 0.5.23's CPU sandbox, no graphs)")
    a = p.parse_args(argv)
    arch, quant = a.model.split(":")
    try:
        rep = run(arch, quant, cpu=a.cpu)
    except Exception as e:  # noqa: BLE001 - reported
        rep = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(rep, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
