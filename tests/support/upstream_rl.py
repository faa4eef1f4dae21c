"""SGLang's own preparation and reload under RL updates, with the plugin switched off: the evidence behind the defer
table (compat/defer.py). Run as `python -m tests.support.upstream_rl FORMAT [FORMAT ...]`; prints one JSON line.

For each format, on the installed release, with SGLANG_TRTLLM_MOE_DISABLE=1 set by the caller: a FusedMoE layer
on flashinfer_trtllm is loaded through SGLang's loader and prepared by SGLang's own process_weights_after_loading,
then updated the ways this release's public API allows — a one-expert disk update, a whole disk update, and a
tensor update (inside a begin/end session where the release has them, plain before), then one more one-expert
tensor update — and after each, every parameter is compared byte for byte with a fresh load of the intended
checkpoint prepared by SGLang, with storage (data_ptr), the Parameter objects and their weight_loader checked.
Only SGLang's CUDA-only helpers are replaced by same-math CPU ones (NVFP4: flashinfer's 128x4 scale interleave by
SGLang's own swizzle_blockscale, as tests/support/sglang_runtime.py does).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import torch  # noqa: E402

from .. import conftest  # noqa: F401  (torchvision shim before SGLang is imported)
from . import sglang_runtime

SEEDS = {"a": 0, "b": 1, "c": 2, "d": 3}
#: the harness's kinds of layer whose SGLang preparation needs the CPU stand-ins of sandbox.sglang_oracle.prep_patches
STANDIN_PREP = ("mxfp8", "mxfp4_experts", "mxfp4_gptoss", "ct_int4")


def _checkpoint(spec, seed: int, experts=None):
    """gpt-oss's fused tensors hold every expert: a "one-expert" update of it is whole."""
    from sglang_trtllm_moe.sandbox import layers

    return layers.random_checkpoint(spec, seed, experts)


def _per_tensor_quant_fp8(input, output_q, output_s, is_static=False):
    """sgl_kernel's per-tensor FP8 quantizer (CUDA only) in torch: scale = amax / 448 unless static, then
    x / scale saturated to e4m3 — what SGLang's ModelOpt FP8 prep uses to requantize w1/w3 to one scale."""
    x = input.float()
    if not is_static:
        output_s.copy_((x.abs().max() / 448.0).clamp(min=1e-12).reshape(output_s.shape))
    output_q.copy_((x / output_s.float().reshape(-1)[0]).clamp(-448.0, 448.0).to(output_q.dtype))


def _stub_cuda_helpers() -> None:
    """SGLang's CUDA-only helpers on the prep paths, replaced by same-math torch: the per-tensor FP8 quantizer
    (sgl_kernel, no CPU build) and flashinfer's 128x4 scale interleave (SGLang's own pure-torch
    swizzle_blockscale computes the same bytes, checked in tests/test_layouts.py)."""
    import importlib

    for mod in ("sglang.kernels.ops.quantization.fp8_kernel", "sglang.srt.layers.quantization.fp8_kernel"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if not hasattr(m, "sgl_per_tensor_quant_fp8"):
            m.sgl_per_tensor_quant_fp8 = _per_tensor_quant_fp8
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - no flashinfer on this release: SGLang takes its own branches
        return
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    flashinfer.nvfp4_block_scale_interleave = lambda x: (
        swizzle_blockscale(x.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1)
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class Case:
    def __init__(self, fmt: str):
        from sglang_trtllm_moe.sandbox import layers
        from sglang_trtllm_moe.sandbox.runtime import init_single_process

        self.fmt = layers.kind_of(fmt)
        self.spec = layers.MoeSpec(num_experts=4, hidden=256, fmt=self.fmt)  # the kind's intermediate (INT4: 256)
        # MX layers: SGLang's own prep needs CPU stand-ins for its CUDA-only helpers (sandbox/layers.py)
        init_single_process(
            "flashinfer_mxfp4" if self.fmt in ("mxfp4_experts", "mxfp4_gptoss") else "flashinfer_trtllm"
        )
        self.model = self._prepared(_checkpoint(self.spec, SEEDS["a"]))
        self.params = dict(self.model.named_parameters())
        self.loaders = {n: getattr(p, "weight_loader", None) for n, p in self.params.items()}
        self.ptrs = {n: p.data_ptr() for n, p in self.params.items()}
        self.intended = _checkpoint(self.spec, SEEDS["a"])

    def _names(self, tensors) -> dict:
        from sglang_trtllm_moe.sandbox import layers

        return layers.checkpoint_names(tensors)

    def _patches(self, model=None):
        import contextlib

        from sglang_trtllm_moe.sandbox import sglang_oracle

        if self.fmt not in STANDIN_PREP:
            return contextlib.nullcontext()
        experts = (model or self.model).experts
        return sglang_oracle.prep_patches(getattr(experts, "scheme", None) or experts.quant_method)

    def _prepared(self, tensors):
        from sglang_trtllm_moe.sandbox import layers

        model = layers.TinyMoeModel(self.spec)
        model.load_weights(self._names(tensors).items())
        with self._patches(model):
            model.experts.quant_method.process_weights_after_loading(model.experts)
        return model

    def _updater(self, path=None):
        from sglang.srt.configs.model_config import ModelConfig

        if path is None:
            path = tempfile.mkdtemp(prefix="upstream-rl-cfg-")
            sglang_runtime.write_safetensors_checkpoint(path, {}, self.spec)
        return sglang_runtime.weight_updater(self.model, ModelConfig(model_path=path))

    def check(self) -> dict:
        fresh = self._prepared(self.intended)
        mine = dict(self.model.named_parameters())
        theirs = dict(fresh.named_parameters())
        wrong = sorted(
            n
            for n in theirs
            if n not in mine or mine[n].shape != theirs[n].shape or not torch.equal(_bytes(mine[n]), _bytes(theirs[n]))
        )
        return {
            "exact": not wrong,
            "differs": wrong[:6],
            "storage_kept": all(mine.get(n) is not None and mine[n].data_ptr() == p for n, p in self.ptrs.items()),
            "parameters_kept": all(mine.get(n) is p for n, p in self.params.items()),
            "loaders_kept": all(getattr(mine.get(n), "weight_loader", None) is w for n, w in self.loaders.items()),
        }

    def from_disk(self, tensors) -> None:

        d = tempfile.mkdtemp(prefix="upstream-rl-")
        sglang_runtime.write_safetensors_checkpoint(d, tensors, self.spec)
        with self._patches():
            ok, msg = self._updater(d).update_weights_from_disk(d, "auto")
        if not ok:
            raise RuntimeError(msg)

    def from_tensor(self, tensors) -> None:
        from sglang_trtllm_moe.compat import features

        named = list(self._names(tensors).items())
        u = self._updater()
        if features.UPDATE_SESSIONS.present():  # the public API requires a session there (0.5.23 enforces it)
            u.begin_weight_update()
            for part in (named[: len(named) // 2], named[len(named) // 2 :]):
                ok, msg = u.update_weights_from_tensor(part)
                if not ok:
                    raise RuntimeError(msg)
            with self._patches():
                u.end_weight_update(run_post_load=False)
            return
        ok, msg = u.update_weights_from_tensor(named)
        if not ok:
            raise RuntimeError(msg)

    def run(self) -> dict:
        out = {}
        steps = (
            ("disk_one_expert", self.from_disk, _checkpoint(self.spec, SEEDS["b"], experts=[2])),
            ("disk_whole", self.from_disk, _checkpoint(self.spec, SEEDS["c"])),
            ("tensor_whole", self.from_tensor, _checkpoint(self.spec, SEEDS["d"])),
            ("tensor_one_expert", self.from_tensor, _checkpoint(self.spec, SEEDS["a"], experts=[1])),
        )
        for name, update, tensors in steps:
            try:
                update(tensors)
                self.intended = {**self.intended, **tensors}
                out[name] = self.check()
            except Exception as e:  # noqa: BLE001 - an upstream failure is a result
                out[name] = {
                    "exact": False,
                    "error": f"{type(e).__name__}: {str(e)[:300]}",
                    "trace": traceback.format_exc()[-1500:],
                }
                break
        out["upstream_correct"] = all(
            v.get("exact") and v.get("storage_kept") and v.get("parameters_kept") and v.get("loaders_kept")
            for k, v in out.items()
            if isinstance(v, dict)
        )
        return out


def main(formats: list[str]) -> dict:
    from sglang.srt.plugins import load_plugins

    from sglang_trtllm_moe import plugin
    from sglang_trtllm_moe.sandbox.runtime import init_single_process

    load_plugins()
    if plugin.state().enabled:
        raise SystemExit("run with SGLANG_TRTLLM_MOE_DISABLE=1: this measures SGLang alone")
    init_single_process("flashinfer_trtllm")
    _stub_cuda_helpers()
    result = {}
    for fmt in formats:
        try:
            result[fmt] = Case(fmt).run()
        except Exception as e:  # noqa: BLE001 - SGLang's own prep cannot run here (e.g. a CUDA-only kernel)
            result[fmt] = {
                "upstream_correct": None,
                "cannot_run": f"{type(e).__name__}: {str(e)[:300]}",
                "trace": traceback.format_exc()[-1500:],
            }
    return result


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_TRTLLM_MOE_DISABLE", "1")
    print(json.dumps(main(sys.argv[1:])))
