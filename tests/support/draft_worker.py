"""A DeepSeek-V3 with a NextN (MTP) draft layer on CPU: SGLang's target and draft ModelRunners, driven by SGLang's
own scheduler-side weight-update manager with its runner `selector` (target / draft / all).

    python -m tests.support.draft_worker QUANT      # one process; prints {check: {"ok": bool, ...}}

The checkpoint (`write_nextn`): the tiny DeepSeek-V3 of the sandbox (dense, MoE, MoE) whose last layer is the NextN
layer, as DeepSeek-V3 ships it (`model.layers.{num_hidden_layers}.*`: a decoder layer with its routed experts, plus
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`); `num_hidden_layers` = 2, `num_nextn_predict_layers` = 1. The
target is `sandbox.models.TinyModel` with `--speculative-algorithm EAGLE` (SGLang: "DeepSeek MTP"); the draft is a
second `ModelRunner(is_draft_worker=True)` on the same checkpoint, built as SGLang's `build_draft_tp_worker` builds
it (`ModelConfig(is_draft_model=True)`: `DeepseekV3ForCausalLMNextN`, inside `draft_model_build_scope()`, sharing
the target's token pools). The update requests go through SGLang's `SchedulerWeightUpdaterManager` (0.5.21+);
its `tp_worker` / `draft_worker` are shells that borrow SGLang's own `weight_update_runners` /
`deserialize_own_rank` (a TpModelWorker / EAGLE worker owns much else that an update never reads).

Every comparison is with a fresh `get_model()` of the intended checkpoint for that runner's model config; the draft's
`embed_tokens` / `lm_head` are left out (SGLang's NextN loader skips them: the EAGLE worker hands the draft the
target's, `set_embed_and_head`, done here too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

#: SGLang's NextN loader leaves these to the EAGLE worker (the target's embedding and head)
SHARED_WITH_TARGET = ("model.embed_tokens.weight", "lm_head.weight")
SPEC_ARGS = dict(
    speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2
)


def write_nextn(out: str, spec) -> str:
    """`spec`'s checkpoint with its last layer as the NextN layer (module docstring)."""
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    t = ck.checkpoint(spec)
    layer, h = len(spec.layers) - 1, spec.hidden
    g = torch.Generator().manual_seed(1000 + spec.seed)
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("shared_head.norm", (h,)), ("eh_proj", (h, 2 * h))):
        w = torch.randn(shape, generator=g) * (h**-0.5 if name == "eh_proj" else 0.02) + (name != "eh_proj")
        t[f"model.layers.{layer}.{name}.weight"] = w.to(torch.bfloat16)
    ck.write_tensors(out, spec, t)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=layer, num_nextn_predict_layers=1)
    # what stays BF16 under the draft's own module names: its decoder is `model.decoder` (Fp8Config matches module
    # paths), its head `model.shared_head.head` (the target's lm_head at run time: SGLang's NextN loader skips it,
    # so a quantized one would hold no scale for process_weights_after_loading)
    qc = cfg.get("quantization_config", {})
    if "ignored_layers" in qc:
        qc["ignored_layers"] += [f"model.decoder.{m}" for m in ("self_attn", "mlp.gate", "mlp.shared_experts")]
    if "ignore" in qc:
        qc["ignore"].append("model.shared_head*")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    hq = os.path.join(out, "hf_quant_config.json")
    if os.path.exists(hq):
        with open(hq) as f:
            body = json.load(f)
        body["quantization"]["exclude_modules"].append("model.shared_head*")
        with open(hq, "w") as f:
            json.dump(body, f, indent=1)
    return out


class Draft:
    """The target TinyModel and its NextN draft runner, and SGLang's scheduler-side update manager over both."""

    def __init__(self, quant: str, workdir: str):
        from sglang_trtllm_moe.sandbox import checkpoints as ck
        from sglang_trtllm_moe.sandbox import models

        self.ck, self.models, self.workdir = ck, models, workdir
        self.spec = ck.TinySpec("deepseek_v3", quant, seed=0, layers=("dense", "moe", "moe"))
        self.dirs: dict = {}
        d0 = self.write(0)
        self.target = models.TinyModel(d0, speculative_draft_model_path=d0, **SPEC_ARGS)
        self.draft = self._draft_runner(d0)
        self._share_embed_and_head()
        self.manager = self._manager()

    def write(self, seed: int) -> str:
        if seed not in self.dirs:
            self.dirs[seed] = write_nextn(os.path.join(self.workdir, f"seed{seed}"), self.spec.with_seed(seed))
        return self.dirs[seed]

    def _draft_config(self, path: str):
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(self.models.server_args(), model_path=path, is_draft_model=True)

    def _draft_runner(self, path: str):
        from sglang.srt.layers.moe.utils import draft_model_build_scope
        from sglang.srt.model_executor.model_runner import ModelRunner

        sa, target = self.models.server_args(), self.target.runner
        with draft_model_build_scope():
            return ModelRunner(
                model_config=self._draft_config(path),
                mem_fraction_static=sa.mem_fraction_static,
                gpu_id=0,
                nccl_port=self.models._STATE["port_args"].nccl_port,
                server_args=sa,
                is_draft_worker=True,
                req_to_token_pool=target.req_to_token_pool,
                token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
                memory_pool_config=target.memory_pool_config,
            )

    def _share_embed_and_head(self):
        """What the EAGLE worker does once both runners exist: the draft uses the target's embedding and head
        (`DeepseekV2ForCausalLM.set_embed_and_head`'s body, without its torch.cuda cache calls)."""
        target, draft = self.target.model, self.draft.model
        del draft.model.embed_tokens.weight
        del draft.lm_head.weight
        draft.model.embed_tokens.weight = target.model.embed_tokens.weight
        draft.lm_head.weight = target.lm_head.weight

    def _manager(self):
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

        class TargetWorker:  # SGLang's own methods on the fields they read
            weight_update_runners = TpModelWorker.weight_update_runners
            deserialize_own_rank = TpModelWorker.deserialize_own_rank
            init_weights_update_group = TpModelWorker.init_weights_update_group
            destroy_weights_update_group = TpModelWorker.destroy_weights_update_group

            def __init__(self, runner):
                self._model_runner = self.model_runner = runner

        class SpecWorker:
            weight_update_runners = BaseSpecWorker.weight_update_runners

            def __init__(self, runner):
                self.draft_worker = type("DraftTpWorker", (), {"draft_runners": [runner]})()

        class Scheduler:
            def record_weight_version_change(self, new_version=None):
                return None

        extra = {}
        if any(f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(SchedulerWeightUpdaterManager)):
            from sglang.srt.distributed import get_tp_group  # 0.5.21 takes the group; later releases look it up

            extra["tp_cpu_group"] = get_tp_group().cpu_group
        return SchedulerWeightUpdaterManager(
            **extra,
            tp_worker=TargetWorker(self.target.runner),
            draft_worker=SpecWorker(self.draft),
            memory_saver_adapter=None,
            flush_cache=lambda empty_cache=False: True,
            is_fully_idle=lambda **kw: True,
            scheduler=Scheduler(),
        )

    # ---- requests, as the tokenizer manager sends them --------------------------------------------------------

    def disk(self, seed: int):
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        req = UpdateWeightFromDiskReqInput(model_path=self.write(seed), load_format="auto")
        return self.manager.update_weights_from_disk(req)

    def tensors(self, named: list, selector: str) -> list:
        """A session on `selector`; `named` in two update_weights_from_tensor calls (everything outside the experts,
        then the experts: SGLang's DeepSeek loader fuses q_a_proj with kv_a_proj_with_mqa within one call only);
        the outputs."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        outs = [self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))]
        try:
            parts = [[kv for kv in named if ".experts." not in kv[0]], [kv for kv in named if ".experts." in kv[0]]]
            for part in (p for p in parts if p):
                req = UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[MultiprocessingSerializer.serialize(part)], selector=selector
                )
                outs.append(self.manager.update_weights_from_tensor(req))
        finally:
            outs.append(self.manager.end_weight_update(EndWeightUpdateReqInput()))
        return outs

    # ---- comparisons ------------------------------------------------------------------------------------------

    def fresh_target(self, seed: int):
        return self.target.fresh(self.write(seed))

    def fresh_draft(self, seed: int):
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.model_loader import get_model

        return get_model(
            model_config=self._draft_config(self.write(seed)),
            load_config=self.draft.load_config,
            device_config=DeviceConfig("cpu", 0),
        )

    def differs(self, model, fresh, skip=()) -> list:
        mine = {n: p for n, p in model.named_parameters() if n not in skip}
        theirs = {n: p for n, p in fresh.named_parameters() if n not in skip}
        if set(mine) != set(theirs):
            return sorted(set(mine) ^ set(theirs))
        return [n for n in mine if not torch.equal(_bytes(mine[n]), _bytes(theirs[n]))]

    def state(self, target_seed: int, draft_seed: int, ptrs: dict) -> dict:
        """Both models vs fresh loads of the seeds intended for each; storage kept; managed layers clean."""
        t = self.differs(self.target.model, self.fresh_target(target_seed))
        d = self.differs(self.draft.model, self.fresh_draft(draft_seed), SHARED_WITH_TARGET)
        moved = [n for n, p in self.pointers().items() if ptrs.get(n) != p]
        unclean = [n for n, layer in self.moe_layers().items() if not _clean(layer)]
        return {
            "target_differs": t[:6],
            "draft_differs": d[:6],
            "moved": moved[:6],
            "unclean": unclean,
            "ok": not t and not d and not moved and not unclean,
        }

    def moe_layers(self) -> dict:
        out = {f"target:{n}": layer for n, layer in self.models.moe_layers(self.target.model).items()}
        out.update({f"draft:{n}": layer for n, layer in self.models.moe_layers(self.draft.model).items()})
        return out

    def pointers(self) -> dict:
        out = {f"target:{n}": p.data_ptr() for n, p in self.target.model.named_parameters()}
        out.update({f"draft:{n}": p.data_ptr() for n, p in self.draft.model.named_parameters()})
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _clean(layer) -> bool:
    from sglang_trtllm_moe import layer_state

    st = layer_state.state_of(layer)
    return st is None or st.clean


def _ok(out) -> bool:
    return all(o.success for o in (out if isinstance(out, list) else [out]))


# ---- checks ------------------------------------------------------------------------------------------------------


def check_built(w: Draft) -> dict:
    """The draft is SGLang's NextN class with one FusedMoE layer, and the plugin owns it as it owns the target's
    layers of the same format (compat/defer.py): prepared in place, or prepared by SGLang and observed."""
    from .model_base import _runner_backends, expected_owner, owner

    layers = w.moe_layers()
    runners = _runner_backends(layers)  # what each layer runs on, as this release records it
    rows = {
        n: {
            "owner": owner(layer),
            "expected": expected_owner(layer),
            "method": type(layer.quant_method).__name__,
            "runner": runners[n],
        }
        for n, layer in layers.items()
    }
    from sglang_trtllm_moe.builtins.selection_hooks import DECISIONS

    drafts = [n for n in rows if n.startswith("draft:")]
    owners = {r["owner"] for r in rows.values()}
    return {
        "ok": type(w.draft.model).__name__ == "DeepseekV3ForCausalLMNextN"
        and len(drafts) == 1
        and all(r["owner"] == r["expected"] for r in rows.values())
        and len(owners) == 1,
        "draft_class": type(w.draft.model).__name__,
        "decisions": [{k: str(d.get(k)) for k in ("what", "code", "winner")} for d in DECISIONS],
        "speculative_moe_runner_backend": str(w.models.server_args().speculative_moe_runner_backend),
        "layers": rows,
        "fresh": w.state(0, 0, w.pointers()),
    }


def check_updates(w: Draft) -> dict:
    """Disk (every runner, as SGLang's manager does it), then tensor sessions with each selector: each runner equals a
    fresh load of the checkpoint it was meant to get; a runner the selector leaves out keeps its bytes."""
    ptrs, steps = w.pointers(), {}
    out = w.disk(1)
    steps["disk"] = {"returned": [out.success, out.message[:200]], **w.state(1, 1, ptrs)}
    steps["disk"]["ok"] &= out.success
    for seed, selector, intended in ((2, "draft", (1, 2)), (3, "all", (3, 3)), (4, "target", (4, 3))):
        named = _nextn_tensors(w, seed)
        outs = w.tensors(named, selector)
        res = {"returned": [[o.success, o.message[:200]] for o in outs], **w.state(*intended, ptrs)}
        res["ok"] &= _ok(outs)
        steps[f"tensor:{selector}"] = res
    return {"ok": all(s["ok"] for s in steps.values()), "steps": steps}


def _nextn_tensors(w: Draft, seed: int) -> list:
    """Every tensor of the NextN checkpoint of `seed`, in name order (what a trainer sends)."""
    from safetensors.torch import load_file

    return sorted(load_file(os.path.join(w.write(seed), "model.safetensors")).items())


def bad_expert_bucket(w: Draft, seed: int, target_too: bool = False) -> list:
    """The draft's expert tensors of `seed` (and the target's last MoE layer's, `target_too`), the draft's expert 3
    gate one column too wide, last: after good tensors of the same layer."""
    layers = (w.spec.moe_layers[0], w.spec.moe_layers[-1]) if target_too else (w.spec.moe_layers[-1],)
    prefixes = tuple(f"model.layers.{n}.mlp.experts." for n in layers)
    good = [kv for kv in _nextn_tensors(w, seed) if kv[0].startswith(prefixes)]
    name = f"{w.ck.expert_base(w.spec, layers[-1], 3, 'gate')}.weight"
    bad = dict(good)[name]
    return [kv for kv in good if kv[0] != name] + [(name, torch.cat([bad, bad[:, :1]], 1))]


def changed_by(w: Draft, update) -> tuple:
    """(what `update()` returned, the names of both runners' parameters whose bytes it changed)."""
    before = {**_state_bytes(w.target.model, "target"), **_state_bytes(w.draft.model, "draft")}
    out = update()
    after = {**_state_bytes(w.target.model, "target"), **_state_bytes(w.draft.model, "draft")}
    return out, [n for n in before if not torch.equal(before[n], after[n])]


def _bad_checkpoint(w: Draft, seed: int):
    """A disk update request: the NextN checkpoint of `seed` with the draft's expert 3 gate one column too wide."""
    from safetensors.torch import save_file
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    out = os.path.join(w.workdir, f"bad{seed}")
    shutil.copytree(w.write(seed), out)
    save_file(dict(_nextn_tensors(w, seed) + bad_expert_bucket(w, seed)[-1:]), os.path.join(out, "model.safetensors"))
    return UpdateWeightFromDiskReqInput(model_path=out, load_format="auto")


def check_refused(w: Draft) -> dict:
    """A malformed expert tensor of the draft's MoE layer, after good tensors of the same layer, selector draft:
    refused, and neither runner changed a byte. Then `mixed`: selector all, the target's experts in the same bucket
    (SGLang loads the target first: the plugin checks the bucket against both runners before it does); `disk`: a
    checkpoint whose draft expert is malformed (a disk update loads every runner, target first)."""
    outs, changed = changed_by(w, lambda: w.tensors(bad_expert_bucket(w, 5), "draft"))
    mixed, mixed_changed = changed_by(w, lambda: w.tensors(bad_expert_bucket(w, 5, target_too=True), "all"))
    disk, disk_changed = changed_by(w, lambda: w.manager.update_weights_from_disk(_bad_checkpoint(w, 5)))
    update = outs[1]
    return {
        "disk": {"returned": [disk.success, disk.message[:300]], "changed": disk_changed[:8]},
        "ok": not update.success and not changed,
        "returned": [update.success, update.message[:300]],
        "changed": changed[:8],
        "n_changed": len(changed),
        "mixed": {"returned": [mixed[1].success, mixed[1].message[:300]], "changed": mixed_changed[:8]},
    }


def check_unresolved(w: Draft) -> dict:
    """The fallback behind check_refused: a draft expert name the request's check cannot place (the NextN names
    switched off here, as for a model whose names the plugin does not know) and a bad tensor after good ones, which
    the loader hook refuses mid-load: answered (False, message), not raised; every managed layer laid out; a good
    update after it gives a fresh load's bytes."""
    from sglang_trtllm_moe.updates import name_index

    payload = bad_expert_bucket(w, 7)
    real = name_index.nextn_aliases
    name_index.nextn_aliases = lambda model, found: {}
    name_index.forget()
    try:
        raised, outs = "", []
        try:
            outs = w.tensors(payload, "draft")
        except Exception as e:  # noqa: BLE001 - what the check is about
            raised = f"{type(e).__name__}: {e}"[:300]
    finally:
        name_index.nextn_aliases = real
        name_index.forget()
    unclean = [n for n, m in w.moe_layers().items() if not _clean(m)]
    ptrs = w.pointers()
    after = w.tensors(_nextn_tensors(w, 8), "all")
    state = w.state(8, 8, ptrs)
    update = outs[1] if len(outs) > 1 else None
    return {
        "ok": not raised and update is not None and not update.success and not unclean and _ok(after) and state["ok"],
        "raised": raised,
        "returned": None if update is None else [update.success, update.message[:400]],
        "unclean": unclean,
        "after": state,
    }


def _state_bytes(model, role: str) -> dict:
    return {f"{role}:{n}": _bytes(p).clone() for n, p in model.named_parameters()}


def check_checker(w: Draft) -> dict:
    """SGLang's weight checker through the same manager (selector all): snapshot, reset_tensors, the same disk update
    again, compare passes on both runners; a flipped byte of the draft's expert weight is caught; the checksum lists
    the draft's expert tensors under SGLang's `draft.` prefix (0.5.23 `_merge_checksum_payloads`)."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    from .sglang_runtime import cpu_checksum

    def check(action: str):
        with cpu_checksum(action):
            out = w.manager.check_weights(CheckWeightsReqInput(action=action))
        return out.success, out.message[:400], out.payload

    steps = {"disk": w.disk(6).success}
    for action in ("snapshot", "reset_tensors"):
        steps[action] = check(action)[:2]
    steps["disk_again"] = w.disk(6).success
    steps["compare"] = check("compare")[:2]
    check("snapshot")
    layer = w.models.moe_layers(w.draft.model)["model.decoder.mlp.experts"]
    flat = layer.w2_weight.data.view(torch.uint8).reshape(-1)
    flat[flat.numel() // 3] ^= 0x10
    try:
        steps["flipped"] = check("compare")[:2]
    finally:
        flat[flat.numel() // 3] ^= 0x10
    ok, _, payload = check("checksum")
    keys = sorted(payload[0].checksums) if ok and payload else []
    draft_experts = [k for k in keys if k.startswith("draft.") and ".experts.w" in k]
    return {
        "ok": steps["disk"]
        and steps["snapshot"][0]
        and steps["reset_tensors"][0]
        and steps["disk_again"]
        and steps["compare"][0]
        and not steps["flipped"][0]
        and "decoder" in steps["flipped"][1]
        and bool(draft_experts),
        "steps": steps,
        "draft_expert_checksums": draft_experts[:6],
    }


CHECKS = {
    "built": check_built,
    "updates": check_updates,
    "refused": check_refused,
    "unresolved": check_unresolved,
    "checker": check_checker,
    "distributed": lambda w: _distributed().check_distributed(w),
    "ipc": lambda w: _ipc().check_ipc(w),
}


def _ipc():
    from . import draft_ipc  # it reads this module's helpers

    return draft_ipc


def _distributed():
    from . import draft_distributed  # it reads this module's helpers

    return draft_distributed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quant = argv[0]
    checks = argv[1].split(",") if len(argv) > 1 else list(CHECKS)
    workdir = tempfile.mkdtemp(prefix="trtllm-moe-draft-")
    report: dict = {}
    try:
        w = Draft(quant, workdir)
        for name in checks:
            try:
                with torch.no_grad():  # as SGLang's scheduler loop runs them (DynamicGradMode)
                    report[name] = CHECKS[name](w)
            except Exception as e:  # noqa: BLE001 - reported
                report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "tb": traceback.format_exc()}
    except Exception as e:  # noqa: BLE001 - reported
        report["_crash"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[-3000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
