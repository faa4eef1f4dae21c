"""The whole-model worker's checks of what is served (tests/support/model_worker.py): load and ownership,
`explain`, the forward against SGLang alone, the weight checker, refused updates and disk failures, routed
experts, checksums, batch invariance, greedy tokens."""

from __future__ import annotations

import glob
import os

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

from .model_base import _STATE_ARGS, PROMPTS, _explain, _runner_backends, expected_owner, owner

#: checkpoint suffixes of per-tensor scales (one value per expert and shard), which validation value-checks
SCALAR_SCALES = ("input_scale", "weight_scale", "weight_scale_2", "weight_global_scale", "input_global_scale")


class Checks:
    """Mixin of model_worker.Worker (model_base.WorkerBase gives compare / write_* / experts_of)."""

    def check_load(self, m) -> dict:
        """Every FusedMoE layer is built, and owned as compat/defer.py says for its format on this release: prepared
        by the plugin (clean, in kernel layout) where SGLang's own preparation is wrong, observed (validated writes,
        SGLang's own layout) where it is right."""
        from sglang_trtllm_moe import layer_state

        layers = m.moe_layers()
        states = {
            n: {
                "owner": owner(layer),
                "expected": expected_owner(layer),
                "clean": bool(layer_state.state_of(layer) and layer_state.state_of(layer).clean),
            }
            for n, layer in layers.items()
        }
        ok = len(layers) == len(self.spec.moe_layers) and all(
            st["owner"] == st["expected"] and (st["owner"] != "plugin" or st["clean"]) for st in states.values()
        )
        return {
            "ok": ok,
            "model_class": type(m.model).__name__,
            "moe_layers": sorted(layers),
            "states": states,
            "runner_backends": _runner_backends(layers),
            "methods": sorted({type(layer.quant_method).__name__ for layer in layers.values()}),
        }

    def check_explain(self, m) -> dict:
        """`explain` (the plugin's rules on config.json, plus SGLang's own resolution with the plugin, platform faked
        to SM100) names the runner every FusedMoE layer of the built model really got, and each is owned as
        compat/defer.py says (prepared by the plugin, or SGLang's own preparation observed by it). The model was
        built with moe_runner_backend="auto": the backend is SGLang's resolution with the plugin's auto-selection,
        not a flag the test set."""
        from sglang_trtllm_moe.compat.platform import resolved_moe_runner_backend

        rep = _explain(m.model_dir, self.spec.quantization)
        layers = m.moe_layers()
        built = _runner_backends(layers)
        managed = {n: owner(layer) for n, layer in layers.items()}
        resolved = resolved_moe_runner_backend(_STATE_ARGS())  # what this process's published ServerArgs resolved
        ok = (
            bool(layers)
            and rep["code"] not in ("NO_FUSED_MOE", "NOT_MOE", "NO_ELIGIBLE_BACKEND")
            and set(built.values()) == {rep["winner"]}
            and rep["sglang"].get("with_plugin") == rep["winner"]
            and resolved == rep["winner"]
            and all(managed[n] == expected_owner(layer) for n, layer in layers.items())
        )
        return {
            "ok": ok,
            "explain": {k: rep[k] for k in ("winner", "code", "reason")},
            "sglang": rep["sglang"],
            "server_args_moe_runner_backend": resolved,
            "built": built,
            "managed": managed,
        }

    def check_forward(self, m) -> dict:
        """Prefill next-token logits vs transformers' own model class on the float32 dequantized checkpoint."""
        from transformers import AutoModelForCausalLM

        ref_dir = self.ck.write_reference(os.path.join(self.workdir, "reference"), self.spec)
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
        ref.eval()
        _, logits = m.generate(PROMPTS, 1)
        with torch.no_grad():
            want = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS]).float()
        rel = float((logits - want).norm() / want.norm())
        per = [float((logits[i] - want[i]).norm() / want[i].norm()) for i in range(len(PROMPTS))]
        top1 = (logits.argmax(-1) == want.argmax(-1)).tolist()
        return {
            "ok": True,
            "rel_err": rel,
            "rel_err_per_prompt": per,
            "top1_equal": top1,
            "reference_class": type(ref).__name__,
        }

    @torch.no_grad()
    def check_weight_checker(self, m) -> dict:
        """SGLang's WeightChecker: snapshot, reset_tensors, replay the final checkpoint from disk, compare passes;
        one flipped byte in an expert weight is caught."""
        from .sglang_runtime import weight_checker

        wc = weight_checker(m.model)
        final = self.write_tensors(self.intended)
        wc.handle("snapshot", role="target")
        wc.handle("reset_tensors", role="target")
        m.update_from_disk(final)
        wc.handle("compare", role="target")
        wc.handle("snapshot", role="target")  # compare consumes the snapshot
        layer_name, layer = sorted(m.moe_layers().items())[-1]
        pname = "w2_weight" if hasattr(layer, "w2_weight") else "w2_weight_packed"  # compressed-tensors INT4: no alias
        w = getattr(layer, pname)
        flat = w.data.view(torch.uint8).reshape(-1)
        pos = flat.numel() // 3
        flat[pos] ^= 0x10
        caught = ""
        try:
            wc.handle("compare", role="target")
        except Exception as e:  # noqa: BLE001 - the check is that it raises
            caught = f"{type(e).__name__}: {str(e)[:600]}"
        flat[pos] ^= 0x10  # restored
        named = f"{layer_name}.{pname}".split("model.", 1)[-1] in caught
        return {"ok": named, "caught": caught, "flipped": f"{layer_name}.{pname} byte {pos}"}

    def check_refused_updates(self, m) -> dict:
        """Malformed updates of one expert's GEMM1 weight, by tensor (in a session) and by disk (a directory holding
        just that tensor): each must be refused with the model untouched. Cases: a float32 tensor for byte storage
        (quantized formats), one column too many, one row too few; and a request that holds well-formed tensors of
        the same expert before the malformed one ("mixed", wrong dtype or extra column). Per case: whether SGLang's
        entry point raised or returned (False, message), and which parameters changed. After each case the
        intended checkpoint is loaded again; at the end the model is compared with a fresh load of it."""
        layer = self.spec.moe_layers[0]
        role = "gate" if self.spec.gated else "up"
        part = self.experts_of(9, layers=[layer], experts=[3])
        suffix = "weight_packed" if self.spec.quant in ("ct_nvfp4", "ct_int4") else "weight"
        wname = f"{self.ck.expert_base(self.spec, layer, 3, role)}.{suffix}"
        w = part[wname]
        bad = {"extra_column": torch.cat([w, w[:, :1]], 1), "missing_row": w[:-1]}
        if w.element_size() == 1 or w.dtype == torch.int32:  # packed bytes, or INT4's int32 words
            bad["wrong_dtype"] = w.float()
        cases = {k: {wname: t} for k, t in bad.items()}
        # a NaN per-tensor scale of the same projection (quantized formats with one: NVFP4, FP8 per-tensor)
        proj = wname.rsplit(".", 1)[0]
        scalar_scales = [
            n
            for n, t in part.items()
            if n.rsplit(".", 1)[0] == proj and n.rsplit(".", 1)[1] in SCALAR_SCALES and t.numel() == 1
        ]
        if scalar_scales:
            cases["nan_scale"] = {scalar_scales[0]: torch.full_like(part[scalar_scales[0]], float("nan"))}
        # one NaN in a block scale of the same projection (NVFP4 / compressed-tensors e4m3 bytes: 0x7F; DeepSeek
        # FP8 block float32 weight_scale_inv: a float NaN) at the last block, the one short header reads never reach
        block = [n for n, t in part.items() if n.rsplit(".", 1)[0] == proj and "scale" in n.rsplit(".", 1)[1]]
        block = [n for n in block if part[n].dim() == 2]
        if block:
            t = part[block[0]].clone()
            if t.element_size() == 1:
                t.view(torch.uint8)[-1, -1] = 0x7F
            else:
                t[-1, -1] = float("nan")
            cases["nan_block_scale"] = {block[0]: t}
        if self.spec.quantization is not None:  # an online quant's source weight: NaN / inf in the trainer's dtype
            for case, value in (("nan_source", float("nan")), ("inf_source", float("inf"))):
                t = w.clone()
                t[3, 7] = value
                cases[case] = {wname: t}
        hows = {}
        if self.paired_halves:  # a checkpoint with an expert's gate and not its up (a bucket may: the session pairs)
            cases["gate_alone"] = {wname: w}
            hows["gate_alone"] = ("disk",)
        mixed = "wrong_dtype" if "wrong_dtype" in bad else "extra_column"
        cases["mixed"] = {**{n: t for n, t in part.items() if n != wname}, wname: bad[mixed]}  # good ones first
        out: dict = {}
        for case, payload in cases.items():
            for how in hows.get(case, ("tensor", "disk")):
                before = m.state_bytes()
                raised, returned = "", None
                try:
                    if how == "tensor":
                        m.begin()
                        try:
                            items = sorted(payload.items(), key=lambda kv: kv[0] == wname)  # the malformed one last
                            returned = m.updater.update_weights_from_tensor(items, load_format=None)
                        finally:
                            m.end()
                    else:
                        d = self.ck.write_tensors(os.path.join(self.workdir, f"bad-{case}"), self.spec, payload)
                        returned = m.updater.update_weights_from_disk(d, "auto")
                except Exception as e:  # noqa: BLE001 - recorded
                    raised = f"{type(e).__name__}: {str(e)[:300]}"
                after = m.state_bytes()
                changed = [n for n in before if not torch.equal(before[n], after[n])]
                out[f"{case}/{how}"] = {
                    "refused": bool(raised) or (returned is not None and not returned[0]),
                    "shape": [list(t.shape) for t in payload.values()][-1],
                    "returned_failure": returned is not None and not returned[0],
                    "raised": raised,
                    "message": None if returned is None else str(returned[1])[:300],
                    "changed": changed[:6],
                    "tensors": len(payload),
                }
                m.update_from_disk(self.write_tensors(self.intended))  # whatever happened: back to the intended
        back = self.compare(m, self.intended, m.pointers())
        return {
            "ok": all(c["refused"] and not c["changed"] for c in out.values()) and back["ok"],
            "cases": out,
            "restored": back["ok"],
            "mixed_with": mixed,
        }

    def check_disk_failures(self, m) -> dict:
        """Issue #27: a disk update that fails after the plugin's pre-check answers (False, message), returns into
        the scheduler, and leaves every byte of the model as it was; a good update afterwards equals a fresh load.
        Faults, on a 2-shard checkpoint (the second shard is the one hit): a shard cut short (refused before SGLang
        touches anything); removed right after the check from a directory without an index (SGLang then loads the
        shard that is left and calls it a success); gone when SGLang opens it (SGLang's rollback re-reads the same
        directory); an I/O error when SGLang reads it. Each from two served states: weights loaded from disk and
        unchanged there (put back by reloading those checkpoints) and weights that came as tensors (put back from
        the host snapshot taken before the update)."""
        import errno

        import safetensors

        from sglang_trtllm_moe.updates import request

        # the fault comes right after the update request's check of the checkpoint (updates/request.py)
        real_check, real_open = request.UpdateRequest.check_checkpoint, safetensors.safe_open
        armed: dict = {}

        def check_then(req, model, files, *a, **k):
            headers = real_check(req, model, files, *a, **k)
            fault = armed.get("after_check")
            if fault is not None:
                fault()
            armed["open"] = armed.get("on_open")
            return headers

        def safe_open(path, *a, **k):
            fault = armed.get("open")
            if fault is not None and str(path) == armed["shard"]:
                armed["open"] = None
                fault()
            return real_open(path, *a, **k)

        def gone():
            os.remove(armed["shard"])

        def io_error():
            raise OSError(errno.EIO, "Input/output error", armed["shard"])

        def cut():
            with open(armed["shard"], "r+b") as f:
                f.truncate(os.path.getsize(armed["shard"]) - 64)

        def no_index():  # shards without model.safetensors.index.json: SGLang loads whatever *.safetensors it finds
            os.remove(os.path.join(os.path.dirname(armed["shard"]), "model.safetensors.index.json"))

        faults = {
            "truncated": {"before": cut},
            "removed_after_check": {"before": no_index, "after_check": gone},
            "gone_at_open": {"on_open": gone},
            "io_error_at_open": {"on_open": io_error},
        }
        new = self.full(7)
        out: dict = {}
        request.UpdateRequest.check_checkpoint, safetensors.safe_open = check_then, safe_open  # type: ignore[method-assign]
        try:
            for served in ("from_disk", "from_tensors"):
                for case, fault in faults.items():
                    if served == "from_tensors":  # the same weights, pushed as tensors: not reproducible from disk
                        m.update_from_tensor(sorted(self.intended.items()))
                    d = self.ck.write_tensors(os.path.join(self.workdir, f"fail-{served}-{case}"), self.spec, new, 2)
                    armed.clear()
                    armed.update(fault, shard=sorted(glob.glob(os.path.join(d, "*.safetensors")))[-1])
                    if "before" in fault:
                        fault["before"]()
                    before = m.state_bytes()
                    raised, returned = "", None
                    try:
                        returned = m.updater.update_weights_from_disk(d, "auto")
                    except Exception as e:  # noqa: BLE001 - recorded: the scheduler would die
                        raised = f"{type(e).__name__}: {str(e)[:300]}"
                    armed.clear()
                    after = m.state_bytes()
                    changed = [n for n in before if not torch.equal(before[n], after[n])]
                    message = "" if returned is None else str(returned[1])
                    out[f"{case}/{served}"] = {
                        "answered": returned is not None and not returned[0],
                        "raised": raised,
                        "message": message[-400:],
                        "changed": changed[:6],
                        "n_changed": len(changed),
                        "put_back": (
                            "refused first"
                            if "refused the whole checkpoint" in message
                            else "reloaded"
                            if "reloaded" in message
                            else "snapshot"
                            if "snapshot" in message
                            else ""
                        ),
                    }
                    m.update_from_disk(self.write_tensors(self.intended))  # a good update afterwards
        finally:
            request.UpdateRequest.check_checkpoint, safetensors.safe_open = real_check, real_open  # type: ignore[method-assign]
        back = self.compare(m, self.intended, m.pointers())
        expected = {"truncated": "refused first"}
        ok = all(
            c["answered"]
            and not c["raised"]
            and not c["changed"]
            and c["put_back"] == expected.get(k.split("/")[0], "reloaded" if k.endswith("from_disk") else "snapshot")
            for k, c in out.items()
        )
        return {"ok": ok and back["ok"], "cases": out, "good_update_after": back["ok"]}

    @torch.no_grad()
    def check_routed_experts(self, m) -> dict:
        """R3 (--enable-return-routed-experts): after each forward (a prefill of PROMPTS, then two decode steps),
        the ids in SGLang's own capturer buffer for every MoE layer equal SGLang's own `select_experts` on the
        router logits that layer's TopK saw in that forward, as sets per token, ties at the cut either way
        (tests/support/r3.py). Then the same generation with the plugin's capture switched off must leave the
        buffer unequal (zeros) wherever the plugin reported: the check can fail."""
        from sglang_trtllm_moe.compat import routed_experts

        from . import r3

        real = routed_experts.capture
        calls: list = []

        def counted(*a, **k):
            calls.append(a[1] if len(a) > 1 else k.get("layer_id"))
            return real(*a, **k)

        routed_experts.capture = counted
        try:
            with r3.recorded_topk(m.model) as seen:
                res = r3.routed_generation(m, PROMPTS, 3)
                moe_layers = sorted({mod.layer_id for mod, *_ in seen})
            routed_experts.capture = lambda *a, **k: None  # the control
            control = r3.routed_generation(m, PROMPTS, 1)["checks"][0]
        finally:
            routed_experts.capture = real
        forwards = {("prefill" if i == 0 else f"decode{i - 1}"): c for i, c in enumerate(res["checks"])}
        # the plugin's runner reported the kernel's routing for every MoE layer (fused runner), or SGLang's own
        # top-k routed every layer and captured it itself (a layer that declares no routing method: Mixtral)
        by_plugin = sorted(set(calls))
        ok = (
            all(c["n_mismatches"] == 0 and c["rows"] > 0 for c in forwards.values())
            and by_plugin in ([], moe_layers)
            and (control["n_mismatches"] > 0 if by_plugin else True)
        )
        return {
            "ok": ok,
            "moe_layers": moe_layers,
            "reported_by_plugin": by_plugin,
            **forwards,
            "without_plugin_capture": control,
        }

    @torch.no_grad()
    def check_checksum(self, m) -> dict:
        """SGLang's WeightChecker `checksum` (per-tensor hashes of each weight dequantized, in checkpoint layout) of a
        fresh load of this model's checkpoint (seed 0), every MoE layer prepared by the plugin — BF16 too, where
        compat/defer.py leaves it to SGLang (0.5.23): the plugin's replacement path, forced as the layer tests force
        it (sglang_runtime.plugin_prepares). tests/test_models.py compares it with what SGLang alone answers for the
        same weights held unquantized (tests/support/checksum_reference.py)."""
        from sglang_trtllm_moe.compat import defer
        from sglang_trtllm_moe.sandbox import models

        from .sglang_runtime import weight_checker

        real = defer.verdict
        defer.verdict = lambda fmt, release=None: None if fmt.name == "bf16" else real(fmt, release)
        try:
            fresh = m.fresh(self.write_full(0))
        finally:
            defer.verdict = real
        owners = sorted({owner(layer) for layer in models.moe_layers(fresh).values()})
        res = weight_checker(fresh).handle("checksum", role="target")
        return {"ok": owners == ["plugin"], "owners": owners, "checksums": dict(res["checksums"])}

    def check_batch_invariance(self, m, steps: int = 6) -> dict:
        """What makes the whole-model, Engine and HTTP server token comparisons stable (docs/TESTING.md "Exact
        comparisons"): the served model's logits do not depend on the batch a request runs in. Every next-token
        logit of PROMPTS (prefill, then `steps` decode steps, through SGLang's ScheduleBatch / ForwardBatch) is the
        same bit for bit when the prompts run as one batch, each alone, in reverse order, and when a request is
        prefilled again with its own output so far (SGLang's retract and its radix cache run it so) instead of
        decoded. Then greedy tokens compared across batch shapes cannot flip on a near-tie, whatever the margin.
        Run for the models the Engine and HTTP server tests serve (JOBS); not a property of every model here
        (measured: Mixtral BF16 differs alone vs batched, DeepSeek's MLA prefill vs its absorbed decode)."""
        from sglang.benchmark import one_batch

        runner = m.runner

        def run(prompts, n):
            """Next-token logits [len(prompts), n + 1, vocab] and tokens [len(prompts)][n + 1]."""
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
            try:
                with torch.no_grad():
                    ids, logits, batch = one_batch.extend(m._reqs(prompts, n + 1), runner)
                    steps_logits, toks = [logits.float().clone()], [ids.tolist()]
                    for _ in range(n):
                        ids, logits = one_batch.decode(ids, batch, runner)
                        steps_logits.append(logits.float().clone())
                        toks.append(ids.tolist())
            finally:
                runner.req_to_token_pool.clear()
                runner.token_to_kv_pool_allocator.clear()
            return torch.stack(steps_logits, 1), [list(t) for t in zip(*toks, strict=True)]

        def diff(a, b) -> float:
            return float((a - b).abs().max()) if a.shape == b.shape else float("inf")

        ref, tokens = run(PROMPTS, steps)
        diffs = {}
        diffs["alone"] = max(diff(run([p], steps)[0][0], ref[i]) for i, p in enumerate(PROMPTS))
        diffs["reversed"] = diff(run(PROMPTS[::-1], steps)[0].flip(0), ref)
        k = steps // 2  # prefill prompt + the first k outputs: the logits of decode step k onwards
        again, _ = run([p + t[:k] for p, t in zip(PROMPTS, tokens, strict=True)], steps - k)
        diffs["prefilled_again"] = diff(again, ref[:, k:])
        top2 = ref.topk(2, -1).values
        margin = top2[..., 0] - top2[..., 1]
        return {
            "ok": all(d == 0 for d in diffs.values()),
            "max_abs_diff": diffs,
            # informational: how close the tiny model's greedy choices are (why bit-equality is relied on, not margins)
            "min_top1_margin": float(margin.min()),
            "logit_std": float(ref.std()),
        }

    def check_greedy(self, m) -> dict:
        return self.compare(m, self.intended, m.pointers(), tokens=True)
