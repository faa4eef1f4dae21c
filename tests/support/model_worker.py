"""Whole SGLang models (architecture x format) through every RL flow, each in its own process.

SGLang's process state (published ServerArgs resolved for one model, the parallel runtime, expert-location
metadata) is built once per process and is specific to one model, so each (arch, quant) runs in a process of its
own and yields one report: {check: {"ok": bool, "detail": str, ...}}. tests/test_models.py asserts it.

    python -m tests.support.model_worker ARCH QUANT [--checks a,b,...] [--workdir DIR]   # one model, this process
    python -m tests.support.model_worker --jobs ARCH:QUANT[:check+check],... [--parallel N]

`--jobs`: one parent imports SGLang, the stand-ins and the plugin once (`models.prepare_process(preload=True)`),
then forks one child per job (at most N at a time, default: the CPU count, at most 2), so each model gets a fresh
SGLang process state without paying the imports again; prints {"ARCH:QUANT": report, ...}. Every process runs
single-threaded torch (`models.threads()`), which is what makes a 2-core box fast.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

from .helpers import fork_json

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400], [3, 9, 27, 81, 243, 480, 11, 13, 15]]


def _trainer(port: int, path: str, groups: list) -> None:
    """The trainer side of update_weights_from_distributed, in a process forked from the worker (SGLang is already
    imported there): rank 0 of SGLang's init_custom_process_group, one flattened-bucket broadcast per group."""
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    torch.set_num_threads(1)
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="rl"
    )
    t = torch.load(path)
    for group in groups:
        bucket = FlattenedTensorBucket(named_tensors=[(n, t[n]) for n in group])
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)


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


class Worker:
    def __init__(self, arch: str, quant: str, workdir: str):
        from sglang_trtllm_moe.sandbox import checkpoints as ck

        self.ck = ck
        self.arch, self.quant, self.workdir = arch, quant, workdir
        quant, _, variant = quant.partition("@")
        self.spec = ck.TinySpec(arch, quant, seed=0, **VARIANTS.get(variant, {}).get("spec", {}))
        self.dirs: dict = {}
        self.report: dict = {}
        self._n = 0

    # ---- checkpoints ---------------------------------------------------------------------------------------------

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

    # ---- checks --------------------------------------------------------------------------------------------------

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

    def check_distributed(self, m) -> dict:
        """update_weights_from_distributed over gloo from a second process (the trainer, forked from this one: rank 0
        of a 2-rank group made by SGLang's init_custom_process_group on both sides), two broadcasts, in a session. The
        buckets are flattened (load_format="flattened_bucket", one uint8 broadcast each, as RL frameworks send them):
        gloo cannot broadcast float8_e4m3fn tensors, and every quantized format here holds some (NVFP4 block scales)."""
        import socket

        ptrs = m.pointers()
        new = self.full(7)
        path = os.path.join(self.workdir, "trainer.pt")
        # each bucket ordered by element size, so every tensor starts aligned in the flattened bytes
        names = sorted(new, key=lambda n: (-new[n].element_size(), n))
        torch.save(new, path)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        groups = [names[0::2], names[1::2]]
        groups = [sorted(g, key=lambda n: (-new[n].element_size(), n)) for g in groups]
        import multiprocessing

        trainer = multiprocessing.get_context("fork").Process(target=_trainer, args=(port, path, groups))
        trainer.start()
        try:
            ok, msg = m.updater.init_weights_update_group("127.0.0.1", port, 1, 2, "rl", backend="gloo")
            if not ok:
                raise RuntimeError(msg)
            with m.session():
                for group in groups:
                    received = m.updater.receive_weights_from_distributed(
                        names=group,
                        dtypes=[str(new[n].dtype).replace("torch.", "") for n in group],
                        shapes=[list(new[n].shape) for n in group],
                        group_name="rl",
                        load_format="flattened_bucket",
                    )
                    m.load_distributed(received)
            m.updater.destroy_weights_update_group("rl")
        finally:
            trainer.join(120)
            if trainer.exitcode is None:
                trainer.kill()
                trainer.join()
        if trainer.exitcode != 0:
            return {"ok": False, "detail": f"trainer process failed (exit code {trainer.exitcode})"}
        self.intended = new
        return {**self.compare(m, self.intended, ptrs), "broadcasts": [len(g) for g in groups]}

    def check_random_rounds(self, m, rounds: int = 6) -> dict:
        """Random partial updates: random layers, experts and projections of a new seed each round, by disk or by
        tensors in buckets; after each round the whole model equals a fresh load of what was intended."""
        from sglang_trtllm_moe.sandbox import models

        rng = random.Random(1234)
        ptrs = m.pointers()
        results = []
        for r in range(rounds):
            seed = 100 + r
            layers = rng.sample(self.spec.moe_layers, rng.randint(1, len(self.spec.moe_layers)))
            experts = rng.sample(range(self.spec.num_experts), rng.randint(1, self.spec.num_experts))
            roles = list(self.ck.expert_proj_names(self.spec))
            roles = rng.sample(roles, rng.randint(1, len(roles)))
            if self.paired_halves and ("gate" in roles) != ("up" in roles):  # an expert's halves go together
                roles = sorted({*roles, "gate", "up"})
            part = self.experts_of(seed, layers=layers, experts=experts, roles=roles)
            how = ("disk", "tensor", "flattened_bucket")[r % 3]
            if how == "disk":
                m.update_from_disk(self.ck.write_tensors(os.path.join(self.workdir, f"round{r}"), self.spec, part))
            else:
                items = list(part.items())
                rng.shuffle(items)
                with m.session():
                    for b in models.buckets(items, rng.randint(1, 3)):
                        m.update_from_tensor(b, load_format=None if how == "tensor" else "flattened_bucket")
            self.intended = {**self.intended, **part}
            res = self.compare(m, self.intended, ptrs, tokens=(r == rounds - 1))
            res.update(how=how, layers=sorted(layers), experts=sorted(experts), roles=sorted(roles))
            results.append(res)
        return {"ok": all(x["ok"] for x in results), "rounds": results}

    @torch.no_grad()
    def check_ipc_buckets(self, m) -> dict:
        """checkpoint-engine's flow through SGLang's update_weights_from_ipc (tests/support/checkpoint_engine.py):
        many buckets handed to the model's load_weights, then one post hook (process_weights_after_loading of every
        module). First a run whose middle bucket holds a malformed expert tensor after good ones: refused as a
        whole (the worker's reply names the plugin's refusal, (False, message), no later bucket and no post hook),
        the model then equals a fresh load of what the buckets before it wrote. Then the full checkpoint of a new
        seed in 8 buckets and the finish: equal to a fresh load of it, storage kept, every layer clean. Then
        SGLang's WeightChecker: snapshot, reset_tensors, the same IPC run again, compare passes."""
        import logging

        from sglang_trtllm_moe.sandbox import models

        from . import checkpoint_engine as ce
        from .sglang_runtime import weight_checker

        warnings: list = []

        class Catch(logging.Handler):
            def emit(self, record):
                if record.levelno >= logging.WARNING and "Post-hook" in record.getMessage():
                    warnings.append(record.getMessage())

        def ipc(buckets):
            server = ce.ParameterServer(buckets)
            with ce.installed(server):
                ok, msg = m.updater.update_weights_from_ipc(ce.request())
            return ok, str(msg), server

        catch = Catch()
        logging.getLogger("sglang.srt.checkpoint_engine.checkpoint_engine_worker").addHandler(catch)
        try:
            ptrs = m.pointers()
            # 1. a bad bucket in the middle (experts only: what a failed run leaves is then a checkpoint to load)
            experts = sorted(self.experts_of(12).items())
            parts = models.buckets(experts, 6)
            bad_at = len(parts) // 2
            name, t = next(
                (n, t) for n, t in reversed(parts[bad_at]) if n.endswith((".weight", ".weight_packed")) and t.dim() == 2
            )
            parts[bad_at] = [(n, torch.cat([t, t[:, :1]], 1) if n == name else x) for n, x in parts[bad_at]]
            ok, msg, server = ipc(parts)
            before_bad = dict(kv for p in parts[:bad_at] for kv in p)
            self.intended = {**self.intended, **before_bad}
            after_bad = self.compare(m, self.intended, ptrs)
            bad = {
                "returned": [ok, msg[:300]],
                "replies": ["ok" if not r else r.strip().splitlines()[-1][:300] for r in server.replies],
                "post_hook_ran": server.post_hook_ran,
                "bad_tensor": name,
                "state": after_bad,
            }
            bad["ok"] = (
                not ok
                and len(server.replies) == bad_at + 1
                and all(r == "" for r in server.replies[:bad_at])
                and "refused" in server.replies[bad_at]
                and not server.post_hook_ran
                and after_bad["ok"]
            )
            # 2. the whole checkpoint of a new seed, then the finish: every tensor outside the experts in the first
            # bucket (SGLang's DeepSeek loader fuses q_a_proj with kv_a_proj_with_mqa within one load_weights call
            # only: a bucket boundary between them leaves fused_qkv_a_proj_with_mqa stale, plugin or not), the
            # experts in 8 more
            new = self.full(13)
            rest = sorted((n, t) for n, t in new.items() if ".experts." not in n)
            parts = [rest, *models.buckets(sorted((n, t) for n, t in new.items() if ".experts." in n), 8)]
            ok, msg, server = ipc(parts)
            self.intended = new
            good = {
                "returned": [ok, msg[:300]],
                "buckets": [len(p) for p in parts],
                "post_hook_ran": server.post_hook_ran,
                **self.compare(m, self.intended, ptrs),
            }
            good["ok"] = good["ok"] and ok and server.post_hook_ran and all(r == "" for r in server.replies)
            # 3. SGLang's weight checker across an IPC replay of the same checkpoint
            wc = weight_checker(m.model)
            wc.handle("snapshot", role="target")
            wc.handle("reset_tensors", role="target")
            ok3, msg3, _ = ipc(parts)
            checker = {"returned": [ok3, msg3[:300]], "compare": "passed"}
            try:
                wc.handle("compare", role="target")
            except Exception as e:  # noqa: BLE001 - reported
                checker["compare"] = f"{type(e).__name__}: {str(e)[:400]}"
            checker["ok"] = ok3 and checker["compare"] == "passed"
        finally:
            logging.getLogger("sglang.srt.checkpoint_engine.checkpoint_engine_worker").removeHandler(catch)
        return {
            "ok": bad["ok"] and good["ok"] and checker["ok"] and not warnings,
            "bad_bucket": bad,
            "full": good,
            "checker": checker,
            "post_hook_warnings": warnings[:3],
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

    def check_threaded_disk_ab(self, m, runs: int = 10) -> dict:
        """sglang#20: update_weights_from_disk A->B (and back) with SGLang's default loading. DeepSeek's loader
        (models/deepseek_common/deepseek_weight_loader.py) submits one task per CPU tensor to a ThreadPoolExecutor
        (`should_async_load`: True for every CPU tensor), so shards of one expert are written concurrently. Each
        run must equal a fresh load byte for byte, storage kept; the threads that wrote are counted to prove the
        pool was used. SGLang's per-tensor path is what this is about: the plugin's batched writes (which take the
        validated expert tensors out of that pool, batched_writes.stream) are switched off here; tests/
        test_batched_writes.py covers them on the disk path."""
        import threading

        from sglang.srt.model_loader import utils as loader_utils

        from sglang_trtllm_moe import layer_state
        from sglang_trtllm_moe.updates import batched_writes

        seen: dict = {}
        real, real_locked = layer_state.before_write, layer_state.before_write_locked

        def spy(layer, name, expert_id):
            seen[threading.get_ident()] = threading.current_thread().name
            return real(layer, name, expert_id)

        def spy_locked(layer, st, name, expert_id):  # what the loader hook calls under the layer's lock
            seen[threading.get_ident()] = threading.current_thread().name
            return real_locked(layer, st, name, expert_id)

        layer_state.before_write, layer_state.before_write_locked = spy, spy_locked
        try:
            with batched_writes.disabled():
                a, b = self.write_full(0), self.write_full(1)
                fresh = {0: m.fresh(a), 1: m.fresh(b)}
                ptrs = m.pointers()
                results = []
                for r in range(runs):
                    for target, path in ((1, b), (0, a)):
                        seen.clear()
                        m.update_from_disk(path)
                        diff = m.differences(fresh[target])
                        moved = [n for n, p in m.pointers().items() if ptrs.get(n) != p]
                        writer_threads = sorted(set(seen.values()))
                        if target == 1:
                            results.append(
                                {
                                    "run": r,
                                    "differs": diff[:6],
                                    "n_differs": len(diff),
                                    "moved": moved[:4],
                                    "writer_threads": len(writer_threads),
                                    "pool_threads": sum(1 for t in writer_threads if t != "MainThread"),
                                }
                            )
                        elif diff or moved:
                            results.append({"run": r, "back_to_A_differs": diff[:6], "moved": moved[:4]})
        finally:
            layer_state.before_write, layer_state.before_write_locked = real, real_locked
        failed = [x for x in results if x.get("n_differs") or x.get("moved") or x.get("back_to_A_differs")]
        pool = all(x.get("pool_threads", 1) > 0 for x in results)
        return {
            "ok": not failed and pool,
            "runs": runs,
            "failed_runs": len(failed),
            "pool_used_every_run": pool,
            "async_load_on_cpu": bool(loader_utils.should_async_load(torch.zeros(1))),
            "results": results,
        }

    ON_REQUEST = ("threaded_disk_ab", "routed_experts", "checksum", "batch_invariance", "disk_a_b_a", "ipc_buckets")
    ORDER = (
        "load",
        "forward",
        "batch_invariance",
        "disk_a_b_a",
        "disk_full",
        "disk_partial",
        "tensor_buckets",
        "tensor_flattened_bucket",
        "tensor_split_shards",
        "session_forward",  # before session_direct, which leaves DeepSeek's MLA w_kc / w_vc stale (docs/TESTING.md)
        "session_direct",
        "distributed",
        "random_rounds",
        "ipc_buckets",
        "weight_checker",
        "greedy",
        "checksum",
        "refused_updates",
        "disk_failures",
        "threaded_disk_ab",
        "explain",
        "routed_experts",
    )

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


# ---- jobs: one forked child per model ------------------------------------------------------------------------------

#: what tests/test_models.py runs (arch, quant, extra on-request checks): every architecture with its NVFP4 and FP8
#: checkpoint where SGLang builds them with FusedMoE, Mixtral BF16, and the quantized Mixtral SGLang builds without
#: FusedMoE (explain must say so).
#: the models whose weight-checker checksum is compared with SGLang alone's (check_checksum; each in its own job's
#: process: a process's resolved quantization turns another checkpoint's BF16 experts into online NVFP4 / FP8)
CHECKSUM_JOBS = (("qwen3_moe", "nvfp4"), ("qwen3_moe", "fp8"), ("mixtral", "bf16"))

#: checkpoint suffixes of per-tensor scales (one value per expert and shard), which validation value-checks
SCALAR_SCALES = ("input_scale", "weight_scale", "weight_scale_2", "weight_global_scale", "input_global_scale")

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

JOBS = (
    # batch_invariance: the models sglang.Engine and the HTTP server serve in the tests (docs/TESTING.md "Exact
    # comparisons": measured, not assumed; Mixtral BF16 and DeepSeek's prefill-vs-decode are not batch-invariant)
    ("qwen3_moe", "nvfp4", ("checksum", "batch_invariance")),
    ("qwen3_moe", "fp8", ("checksum",)),
    # ipc_buckets: checkpoint-engine's flow on a DeepSeek-V3 of each kind of owner (NVFP4: the plugin prepares it;
    # FP8 block: SGLang prepares it, the plugin observes it, compat/defer.py)
    ("deepseek_v3", "nvfp4", ("threaded_disk_ab", "ipc_buckets")),
    ("deepseek_v3", "fp8_block", ("ipc_buckets",)),
    ("deepseek_v3", "fp8_block@wide", ()),
    # issue #51: Kimi-K2's INT4 (compressed-tensors W4A16 group 32) on a DeepSeek-V3, with DeepSeek's threaded loader
    # and checkpoint-engine's IPC flow
    ("deepseek_v3", "ct_int4", ("threaded_disk_ab", "ipc_buckets")),
    ("nemotron_h", "nvfp4", ("batch_invariance",)),
    ("nemotron_h", "fp8", ()),
    ("mixtral", "bf16", ("checksum",)),
    ("mixtral", "fp8_static", ()),
    ("mixtral", "nvfp4", ()),
    # issue #37: a BF16 checkpoint served with --quantization nvfp4_online (experts quantized to NVFP4 as they load)
    ("qwen3_moe", "nvfp4_online", ("disk_a_b_a",)),
    # the same BF16 checkpoint served with --quantization modelopt_fp4 (0.5.18+: online, per-tensor activations)
    ("qwen3_moe", "nvfp4_online_tensor", ("disk_a_b_a",)),
    # R3: routed experts through the fused runner, per routing method and format (one check each)
    ("qwen3_moe", "nvfp4@r3", ()),
    ("qwen3_moe", "fp8@r3", ()),
    ("qwen3_moe", "bf16@r3", ()),
    ("deepseek_v3", "nvfp4@r3", ()),
    ("deepseek_v3", "fp8_block@r3", ()),
    ("deepseek_v3", "ct_int4@r3", ()),
    ("nemotron_h", "nvfp4@r3", ()),
    ("nemotron_h", "fp8@r3", ()),
    ("mixtral", "bf16@r3", ()),
)


def job_key(arch: str, quant: str) -> str:
    return f"{arch}:{quant}"


def _run_job(arch: str, quant: str, extra: tuple, workdir: str) -> dict:
    checks = None if not extra else [c for c in Worker.ORDER if c not in Worker.ON_REQUEST or c in extra]
    only = VARIANTS.get(quant.partition("@")[2], {}).get("checks")
    if only:
        checks = [c for c in (checks or Worker.ORDER) if c in only]
    return Worker(arch, quant, workdir).run(checks)


def _timed_job(arch, quant, extra, workdir) -> dict:
    t = time.perf_counter()
    rep = _run_job(arch, quant, extra, workdir)
    rep["_seconds"] = round(time.perf_counter() - t, 2)
    return rep


def run_jobs(jobs, parallel: int, workdir: str) -> dict:
    """Fork one child per job from this (prepared, preloaded) process; at most `parallel` at a time."""
    from sglang_trtllm_moe.sandbox import models

    models.prepare_process(preload=True)
    pending = list(jobs)
    running: dict[int, tuple] = {}
    reports: dict = {}
    while pending or running:
        while pending and len(running) < parallel:
            arch, quant, extra = pending.pop(0)
            key = job_key(arch, quant)
            out = os.path.join(workdir, f"{arch}-{quant}.json")
            job = functools.partial(_timed_job, arch, quant, extra, os.path.join(workdir, f"{arch}-{quant}"))
            pid = fork_json(out, job)
            running[pid] = (key, out, time.perf_counter())
        pid, status = os.wait()
        if pid not in running:
            continue
        key, out, t0 = running.pop(pid)
        try:
            with open(out) as f:
                reports[key] = json.load(f)
        except (OSError, ValueError):
            reports[key] = {
                "_crash": {
                    "ok": False,
                    "error": f"the job's process ended with status {status} "
                    f"after {time.perf_counter() - t0:.0f} s, no report",
                }
            }
    return reports


def _parse_jobs(text: str):
    jobs = []
    for item in text.split(","):
        arch, quant, *extra = item.split(":")
        jobs.append((arch, quant, tuple(extra[0].split("+")) if extra else ()))
    return jobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("arch", nargs="?")
    p.add_argument("quant", nargs="?")
    p.add_argument("--checks", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--jobs", default=None, help="ARCH:QUANT[:check+check],...; 'all' = JOBS")
    p.add_argument("--parallel", type=int, default=min(2, os.cpu_count() or 1))
    a = p.parse_args(argv)
    # the jobs write ~3.4 GB of checkpoints per run: a directory of our own is removed at the end (a full /tmp
    # stops every later run on the machine)
    own = a.workdir is None
    workdir = a.workdir or tempfile.mkdtemp(prefix="trtllm-moe-models-")
    try:
        if a.jobs:
            jobs = JOBS if a.jobs == "all" else _parse_jobs(a.jobs)
            t = time.perf_counter()
            reports = run_jobs(jobs, max(1, a.parallel), workdir)
            reports["_total_seconds"] = round(time.perf_counter() - t, 2)
            print(json.dumps(reports, default=str))
            return 0
        report = Worker(a.arch, a.quant, workdir).run(a.checks.split(",") if a.checks else None)
        print(json.dumps(report, default=str))
        return 0
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
