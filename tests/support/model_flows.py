"""The update flows of the whole-model worker (tests/support/model_worker.py): update_weights_from_disk (whole,
A -> B -> A, partial), from tensors (buckets, flattened buckets, split shards) and in sessions (direct writes,
forwards between writes), each compared with a fresh load of what the model should hold."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

from .model_base import PROMPTS, owner


class UpdateFlows:
    """Mixin of model_worker.Worker (model_base.WorkerBase gives compare / write_* / experts_of)."""

    def check_disk_full(self, m) -> dict:
        ptrs = m.pointers()
        m.update_from_disk(self.write_full(1))
        self.intended = self.full(1)
        return self.compare(m, self.intended, ptrs)

    @torch.no_grad()
    def check_disk_a_b_a(self, m) -> dict:
        """update_weights_from_disk A -> B -> A (the issue #37 recipe: a BF16 checkpoint served with --quantization
        nvfp4_online, quantized as it loads). On each: every byte, SGLang's WeightChecker `checksum` (what
        `/weights_checker` answers) and the greedy tokens equal a fresh get_model() of that checkpoint's — what a
        fresh server of it would serve. The comparison can fail: A's and B's expert checksums differ."""
        from .sglang_runtime import weight_checker

        ptrs = m.pointers()
        steps = {}
        for key, seed in (("B", 1), ("A", 0)):
            d = self.write_full(seed)
            m.update_from_disk(d)
            fresh = m.fresh(d)
            mine = dict(weight_checker(m.model).handle("checksum", role="target")["checksums"])
            theirs = dict(weight_checker(fresh).handle("checksum", role="target")["checksums"])
            tokens, _ = m.generate(PROMPTS, 4)
            fresh_tokens, _ = m.generate(PROMPTS, 4, model=fresh)
            diff = m.differences(fresh)
            del fresh
            steps[key] = {
                "differs": diff[:8],
                "checksums_differ": sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))[:8],
                "n_checksums": len(mine),
                "tokens": tokens,
                "fresh_tokens": fresh_tokens,
                "experts": {n: v for n, v in mine.items() if n.endswith(".experts.w13_weight")},
            }
        self.intended = self.full(0)
        moved = [n for n, p in m.pointers().items() if ptrs.get(n) != p]
        apart = bool(steps["A"]["experts"]) and all(
            steps["A"]["experts"][n] != steps["B"]["experts"][n] for n in steps["A"]["experts"]
        )
        ok = (
            all(not s["differs"] and not s["checksums_differ"] for s in steps.values())
            and all(s["tokens"] == s["fresh_tokens"] for s in steps.values())
            and not moved
            and apart
            and steps["A"]["tokens"] != steps["B"]["tokens"]
        )
        return {"ok": ok, "steps": steps, "moved": moved[:8], "a_b_checksums_apart": apart}

    def check_disk_partial(self, m) -> dict:
        """A checkpoint dir holding two experts of the last MoE layer only (experts-only, as a trainer writes it)."""
        ptrs = m.pointers()
        layer = self.spec.moe_layers[-1]
        part = self.experts_of(2, layers=[layer], experts=[1, 5])
        d = self.ck.write_tensors(os.path.join(self.workdir, "partial-disk"), self.spec, part)
        m.update_from_disk(d)
        self.intended = {**self.intended, **part}
        return {**self.compare(m, self.intended, ptrs), "tensors": len(part)}

    def _ordered_payload(self, tensors: dict) -> list:
        """Checkpoint order, except that expert 0's GEMM1 halves of the first MoE layer go in the first and the
        last call (one expert's w1 and w3 in different calls)."""
        items = sorted(tensors.items())
        first = self.ck.expert_base(self.spec, self.spec.moe_layers[0], 0, "gate" if self.spec.gated else "up")
        last = self.ck.expert_base(self.spec, self.spec.moe_layers[0], 0, "up" if self.spec.gated else "down")
        head = [kv for kv in items if kv[0].startswith(first + ".")]
        tail = [kv for kv in items if kv[0].startswith(last + ".")]
        rest = [kv for kv in items if kv not in head and kv not in tail]
        return head + rest + tail

    def _buckets_update(self, m, seed: int, load_format) -> dict:
        from sglang_trtllm_moe.sandbox import models

        ptrs = m.pointers()
        new = self.full(seed)
        payload = self._ordered_payload(new)
        parts = models.buckets(payload, 3)  # 3 buckets: each MoE layer's tensors span two of them
        with m.session():
            for part in parts:
                m.update_from_tensor(part, load_format=load_format)
        self.intended = new
        return {**self.compare(m, self.intended, ptrs), "buckets": [len(p) for p in parts]}

    def check_tensor_buckets(self, m) -> dict:
        return self._buckets_update(m, 3, None)

    def check_tensor_flattened_bucket(self, m) -> dict:
        return self._buckets_update(m, 4, "flattened_bucket")

    def check_tensor_split_shards(self, m) -> dict:
        """One expert's w1 and w3 in separate update_weights_from_tensor calls, each its own session (an entry point
        ends in between, so the expert is prepared with one half new and the other old, then again). An online quant
        (`paired_halves`) quantizes a gated expert's w1 and w3 together, so its loader holds a half until the other
        arrives: there the two calls are one session's, and after the first nothing of the model has changed."""
        if self.paired_halves:
            return self._split_shards_one_session(m)
        ptrs = m.pointers()
        layer = self.spec.moe_layers[0]
        roles = ["gate", "up"] if self.spec.gated else ["up", "down"]
        steps = []
        for role in roles:
            part = self.experts_of(5, layers=[layer], experts=[3], roles=[role])
            m.update_from_tensor(sorted(part.items()))
            self.intended = {**self.intended, **part}
            steps.append(self.compare(m, self.intended, ptrs))
        return {"ok": all(s["ok"] for s in steps), "steps": steps}

    @property
    def paired_halves(self) -> bool:
        """An online quant of gated experts: SGLang quantizes w1 and w3 of an expert together (one global scale), so
        an update sends both halves of an expert (in one request, or in calls of one session)."""
        return self.spec.quantization is not None and self.spec.gated

    def _split_shards_one_session(self, m) -> dict:
        ptrs = m.pointers()
        layer = self.spec.moe_layers[0]
        with m.session():
            before = m.state_bytes()  # inside the session: every managed layer in checkpoint layout
            gate = self.experts_of(5, layers=[layer], experts=[3], roles=["gate"])
            m.update_from_tensor(sorted(gate.items()))
            after_gate = m.state_bytes()
            held = [n for n in before if not torch.equal(before[n], after_gate[n])]
            up = self.experts_of(5, layers=[layer], experts=[3], roles=["up"])
            m.update_from_tensor(sorted(up.items()))
        self.intended = {**self.intended, **gate, **up}
        out = self.compare(m, self.intended, ptrs)
        out["changed_by_the_gate_alone"] = held[:8]
        out["ok"] = out["ok"] and not held
        return out

    def check_session_direct(self, m) -> dict:
        """begin_weight_update; whole parameters written with load_format="direct" (no loader, SGLang's
        default_weight_loader) in two calls; end_weight_update. The payload is SGLang's own checkpoint layout of a
        fresh model of seed 6 (its layers returned to checkpoint layout by the plugin's un-prepare, or by SGLang's own
        restore where SGLang prepares the format: compat/defer.py)."""
        from sglang_trtllm_moe import layer_state
        from sglang_trtllm_moe.sandbox import models

        ptrs = m.pointers()
        target = self.full(6)
        src = m.fresh(self.write_tensors(target))
        managed = [layer for layer in m.moe_layers().values() if layer_state.state_of(layer) is not None]
        # every managed layer in the process: checkpoint layout (as begin_weight_update does)
        layer_state.unprepare_all()
        for layer in models.moe_layers(src).values():  # layers SGLang prepares itself: its own restore (begin does it)
            if owner(layer) == "sglang":
                layer.quant_method.restore_weights_before_loading(layer)
        payload = [(n, p.detach().clone()) for n, p in src.named_parameters()]
        layer_state.flush_all(end_session=True)
        del src
        prepared_inside = False
        with m.session():
            # the plugin's layers are in checkpoint layout inside the session (vacuous where SGLang owns every layer)
            open_dirty = all(bool(layer_state.state_of(layer).dirty_experts()) for layer in managed)
            half = len(payload) // 2
            for part in (payload[:half], payload[half:]):
                m.update_from_tensor(part, load_format="direct")
                prepared_inside |= any(layer_state.state_of(layer).clean for layer in managed)
        if prepared_inside:
            return {"ok": False, "detail": "a layer was prepared inside an open begin/end session"}
        self.intended = target
        out = self.compare(m, self.intended, ptrs)
        out["ok"] = out["ok"] and open_dirty
        out["unprepared_at_begin"] = open_dirty
        return out

    @torch.no_grad()
    def check_session_forward(self, m) -> dict:
        """Generation inside a begin/end session (what the README tells RL loops to pause, and why): between two
        `update_weights_from_tensor` buckets — the first holds every tensor of experts [0, E/2) of every MoE layer
        of a new checkpoint, the second the rest — a forward runs. The plugin lays out what it runs (a layer with
        experts in checkpoint layout is flushed before its kernel call), so the kernel of every layer the plugin
        prepares is handed each expert wholly old or wholly new, laid out: exactly the bytes of a fresh load of that
        mix (experts < E/2 new, the rest old), and the forward's logits are that fresh load's, bit for bit (the same
        batch) — neither the old model's nor the new one's. After the session the model is a fresh load of the new
        checkpoint. Control: an expert written again (checkpoint layout) and the runner's layout step skipped, the
        kernel is handed bytes no fresh load holds — the byte check catches a layout mix. Layers SGLang prepares
        itself (compat/defer.py) keep SGLang's own session semantics (its canonical layout until the session ends):
        reported, and only the end state is asserted for them."""
        from sglang_trtllm_moe import emulator, kernel_api, layer_state, runner
        from sglang_trtllm_moe.sandbox import models

        ptrs = m.pointers()
        old = self.intended
        new = self.full(8)
        half = self.spec.num_experts // 2
        first = self.experts_of(8, experts=list(range(half)))
        rest = [(n, t) for n, t in sorted(new.items()) if n not in first]
        layers = m.moe_layers()
        managed = {n for n, layer in layers.items() if layer_state.state_of(layer) is not None}
        fresh_mixed = m.fresh(self.write_tensors({**old, **first}))
        fresh_layers = models.moe_layers(fresh_mixed)
        _, want_logits = m.generate(PROMPTS, 1, model=fresh_mixed)
        _, before_logits = m.generate(PROMPTS, 1)
        seen: dict = {}
        owner_of = {p.data_ptr(): (n, pname) for n, layer in layers.items() for pname, p in layer.named_parameters()}

        def spy(real):
            def call(*a, **kw):
                for arg in ("gemm1_weights", "gemm2_weights"):
                    t = kw.get(arg)
                    if isinstance(t, torch.Tensor) and t.data_ptr() in owner_of:
                        seen[owner_of[t.data_ptr()]] = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
                return real(*a, **kw)

            return call

        def handed_like_fresh() -> list:
            """Parameters of managed layers the kernel was handed with bytes other than the fresh mixed load's."""
            bad = []
            for (n, pname), got in seen.items():
                if n not in managed:
                    continue
                want = dict(fresh_layers[n].named_parameters())[pname]
                if not torch.equal(got, want.detach().contiguous().reshape(-1).view(torch.uint8)):
                    bad.append(f"{n}.{pname}")
            return bad

        reals = {name: getattr(emulator, name) for name in kernel_api.KERNEL_FUNCTIONS}
        for name, real in reals.items():
            setattr(emulator, name, spy(real))
        control: dict = {}
        try:
            m.begin()
            try:
                m.update_from_tensor(sorted(first.items()))
                _, mid_logits = m.generate(PROMPTS, 1)
                mid_differs = m.differences(fresh_mixed)
                mid_seen = sorted({n for n, _ in seen})
                mid_bad = handed_like_fresh()
                mid_clean = sorted(n for n in managed if layer_state.state_of(layers[n]).clean)
                if managed:  # the control: one expert of a managed layer written again, the layout step skipped
                    target = sorted(managed)[0]
                    layer_idx = int(target.split(".layers.")[1].split(".")[0])
                    again = {k: v for k, v in first.items() if f".layers.{layer_idx}." in k and ".experts.0." in k}
                    m.update_from_tensor(sorted(again.items()))
                    seen.clear()
                    real_ensure = runner.ensure_prepared
                    runner.ensure_prepared = lambda layer: None
                    try:
                        m.generate(PROMPTS, 1)
                    finally:
                        runner.ensure_prepared = real_ensure
                    control = {"layer": target, "caught": [b for b in handed_like_fresh() if b.startswith(target)]}
                m.update_from_tensor(rest)
            finally:
                m.end()
        finally:
            for name, real in reals.items():
                setattr(emulator, name, real)
        del fresh_mixed
        self.intended = new
        out = self.compare(m, self.intended, ptrs)
        _, after_logits = m.generate(PROMPTS, 1)
        mixed_is_own = not torch.equal(mid_logits, before_logits) and not torch.equal(mid_logits, after_logits)
        logits_equal = bool(torch.equal(mid_logits, want_logits))
        out.update(
            managed=sorted(managed),
            handed_to_kernel=mid_seen,
            handed_unlike_fresh_mix=mid_bad,
            model_differs_from_fresh_mix=mid_differs[:8],
            clean_after_forward=mid_clean,
            logits_equal_fresh_mix=logits_equal,
            mix_is_neither_old_nor_new=mixed_is_own,
            control=control,
        )
        if managed == set(layers):  # every layer the plugin's: the forward is the fresh mix's, bit for bit
            out["ok"] = out["ok"] and logits_equal and mixed_is_own
        out["ok"] = (
            out["ok"]
            and set(mid_seen) >= managed
            and not mid_bad
            and mid_clean == sorted(managed)
            and (not managed or bool(control.get("caught")))
        )
        return out
