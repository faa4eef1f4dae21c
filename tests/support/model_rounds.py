"""The whole-model worker's flows across processes and threads (tests/support/model_worker.py):
update_weights_from_distributed from a forked trainer, random rounds, checkpoint-engine's IPC buckets, and
DeepSeek's threaded disk loader A -> B -> A."""

from __future__ import annotations

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch


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


class RankFlows:
    """Mixin of model_worker.Worker (model_base.WorkerBase gives compare / write_* / experts_of)."""

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
