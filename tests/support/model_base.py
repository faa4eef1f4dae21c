"""The whole-model worker's base (tests/support/model_worker.py): the tiny checkpoints of one (arch, quant), the
comparison of a served model with a fresh `get_model()` of what it should hold, the loop over the checks, and
who prepares each FusedMoE layer (the plugin or SGLang: compat/defer.py)."""

from __future__ import annotations

import os
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]

#: variants of a tiny checkpoint ("QUANT@VARIANT"): other sizes, and the only checks that run on them.
#: wide: DeepSeek-V3 FP8 block with expert scales [8, 9] (hidden 1152, intermediate 1024; a real DeepSeek-V3 expert's
#: are [16, 56]): more than the 64 values a disk update's pre-check used to read, so a bad value there went unseen
VARIANTS = {
    "wide": {
        "spec": {"hidden": 1152, "moe_intermediate": 1024},
        "checks": ("load", "refused_updates", "disk_failures"),
    },
    # R3: SGLang's routed-experts capturer on. With chunked prefill off (the harness's -1) SGLang sizes its capture
    # buffer from max_running_requests alone (state_capturer/routed_experts.py), which a 20-token prefill overflows
    "r3": {
        "server_args": {"enable_return_routed_experts": True, "chunked_prefill_size": 4096},
        "checks": ("routed_experts",),
    },
}


def _build_only(model_dir: str):
    """The model class SGLang builds for `model_dir`, constructed as DefaultModelLoader.load_model constructs it
    (quant config, dtype, device), without loading weights: for models SGLang cannot finish loading on a CPU box
    (QuantMixtralForCausalLM's ModelOpt FP4 linear layers move their scales with `.cuda()` after loading)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from sglang_trtllm_moe.sandbox import models

    mc = ModelConfig.from_server_args(models.server_args(), model_path=model_dir)
    lc = LoadConfig(load_format=models.server_args().load_format)
    quant_config = loader._get_quantization_config(mc, lc)
    with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
        return loader._initialize_model(mc, lc, quant_config)


class WorkerBase:
    """One (arch, quant): its checkpoints, the comparison, the run; the checks are the mixins' (model_worker.Worker)."""

    def __init__(self, arch: str, quant: str, workdir: str):
        from sglang_trtllm_moe.sandbox import checkpoints as ck

        self.ck = ck
        self.arch, self.quant, self.workdir = arch, quant, workdir
        quant, _, variant = quant.partition("@")
        self.spec = ck.TinySpec(arch, quant, seed=0, **VARIANTS.get(variant, {}).get("spec", {}))
        self.dirs: dict = {}
        self.report: dict = {}
        self._n = 0

    def spec_for(self, seed: int):
        return self.spec.with_seed(seed)

    def full(self, seed: int) -> dict:
        return self.ck.checkpoint(self.spec_for(seed))

    def write_full(self, seed: int) -> str:
        if seed not in self.dirs:
            self.dirs[seed] = self.ck.write(os.path.join(self.workdir, f"seed{seed}"), self.spec_for(seed))
        return self.dirs[seed]

    def write_tensors(self, tensors: dict) -> str:
        self._n += 1
        return self.ck.write_tensors(os.path.join(self.workdir, f"mix{self._n}"), self.spec, tensors)

    def experts_of(self, seed: int, layers=None, experts=None, roles=None) -> dict:
        return self.ck.quantized_experts(self.spec_for(seed), layers=layers, experts=experts, roles=roles)

    # ---- comparisons ---------------------------------------------------------------------------------------------

    def compare(self, m, intended: dict, ptrs: dict, tokens: bool = False) -> dict:
        """The model vs a fresh get_model() of `intended`: every parameter/buffer byte, storage, layer state."""
        from sglang_trtllm_moe import layer_state

        fresh = m.fresh(self.write_tensors(intended))
        diff = m.differences(fresh)
        moved = [n for n, p in m.pointers().items() if ptrs.get(n) != p]
        # layers the plugin prepares must be back in kernel layout; layers it defers to SGLang have no state
        unclean = [
            n
            for n, layer in m.moe_layers().items()
            if (layer_state.state_of(layer) is not None and not layer_state.state_of(layer).clean)
            or owner(layer) != expected_owner(layer)
        ]
        out = {"differs": diff[:8], "n_differs": len(diff), "moved": moved[:8], "unclean": unclean}
        if tokens:
            a, _ = m.generate(PROMPTS, 4)
            b, _ = m.generate(PROMPTS, 4, model=fresh)
            out["tokens"], out["fresh_tokens"] = a, b
        out["ok"] = not diff and not moved and not unclean and (not tokens or out["tokens"] == out["fresh_tokens"])
        del fresh
        return out

    # ---- the run -------------------------------------------------------------------------------------------------

    def run(self, checks=None) -> dict:
        from sglang_trtllm_moe.sandbox import models

        t0 = time.perf_counter()
        if not self.spec.supported:
            return self.run_without_fused_moe()
        variant = VARIANTS.get(self.quant.partition("@")[2], {})
        m = models.TinyModel(self.write_full(0), **self.spec.server_args(), **variant.get("server_args", {}))
        self.intended = self.full(0)
        self.report["_load_s"] = round(time.perf_counter() - t0, 2)
        for name in self.ORDER:
            if (checks and name not in checks) or (not checks and name in self.ON_REQUEST):
                continue
            t = time.perf_counter()
            try:
                res = getattr(self, f"check_{name}")(m)
            except Exception as e:  # noqa: BLE001 - reported
                res = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {str(e)[:500]}",
                    "traceback": traceback.format_exc()[-2000:],
                }
                if m._session is not None:
                    m.end()
            res["seconds"] = round(time.perf_counter() - t, 2)
            self.report[name] = res
        return self.report

    def run_without_fused_moe(self) -> dict:
        """A combination SGLang builds without FusedMoE (quantized Mixtral other than fp8 / compressed-tensors:
        QuantMixtralForCausalLM). SGLang's own model class is constructed as its loader constructs it (loading
        stops on this box: the ModelOpt FP4 linear layers move their scales with `.cuda()`), and `explain` must
        say there is no FusedMoE layer instead of naming a winner; SGLang's resolution is not moved by the plugin."""
        from sglang_trtllm_moe.sandbox import models

        t = time.perf_counter()
        d = self.write_full(0)
        models.init(d)
        model = _build_only(d)
        layers = models.moe_layers(model)
        rep = _explain(d)
        ok = (
            not layers
            and rep["code"] == "NO_FUSED_MOE"
            and not rep["candidates"]
            and rep["sglang"].get("with_plugin") == rep["sglang"].get("upstream_alone") is not None
        )
        self.report["built_without_fused_moe"] = {
            "ok": ok,
            "model_class": type(model).__name__,
            "fused_moe_layers": sorted(layers),
            "expert_modules": sorted({type(mod).__name__ for n, mod in model.named_modules() if ".experts." in n}),
            "explain": {k: rep[k] for k in ("winner", "code", "reason")},
            "sglang": rep["sglang"],
            "seconds": round(time.perf_counter() - t, 2),
        }
        return self.report


def owner(layer) -> str:
    """ "plugin" (the plugin prepares the layer: layer_state), "sglang" (SGLang prepares it, the plugin observes:
    compat/defer.py), or "none"."""
    from sglang_trtllm_moe import layer_state

    if layer_state.state_of(layer) is not None:
        return "plugin"
    return "sglang" if layer_state.observed(layer) is not None else "none"


def expected_owner(layer) -> str:
    """What compat/defer.py says for this layer's format on the installed release."""
    from sglang_trtllm_moe import layer_state
    from sglang_trtllm_moe.compat import defer

    st = layer_state.state_of(layer)
    fmt = st.fmt if st is not None else layer_state.observed(layer)
    if fmt is None:
        return "plugin or sglang"  # neither: never what is expected
    v = defer.verdict(fmt)
    return "sglang" if v is not None and v.upstream_correct else "plugin"


def _runner_backends(layers: dict) -> dict:
    """The MoE runner backend each built FusedMoE layer got: FusedMoE.runner_backend (0.5.23: asked of its quant
    method); before, the quant method's own `_moe_runner_backend` where it keeps one, else the process-wide one:
    what FusedMoE and the quant methods' trtllm fast paths read (ModelOpt FP8 on 0.5.22 builds a TRITON MoeRunner
    as its fallback and still runs flashinfer_trtllm from `apply` when the backend says so)."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    out = {}
    for n, layer in layers.items():
        qm = layer.quant_method
        b = (
            getattr(layer, "runner_backend", None)
            or getattr(qm, "_moe_runner_backend", None)
            or get_moe_runner_backend()
        )
        out[n] = getattr(b, "value", str(b))
    return out


def _STATE_ARGS():
    from sglang_trtllm_moe.sandbox import models

    return models._STATE["server_args"]


def _explain(model_dir: str, quantization: str | None = None) -> dict:
    """explain on a faked SM100, with the harness's own ServerArgs for SGLang's resolution (Nemotron-H needs
    disable_radix_cache on a faked platform: SGLang's Mamba snapshot check asks for a real CUDA platform)."""
    from sglang_trtllm_moe.explain import explain_model
    from sglang_trtllm_moe.sandbox import models

    extra = {
        k: v
        for k, v in models.DEFAULT_SERVER_ARGS.items()
        if k in ("disable_radix_cache", "attention_backend", "bf16_gemm_backend", "disable_cuda_graph")
    }
    return explain_model(model_dir, sm=100, server_args=extra, quantization=quantization)
