"""Whole SGLang models on a CPU box, built and driven the way a server and an RL framework drive them.

`TinyModel(model_dir)` is SGLang's own ModelRunner for a local checkpoint (sandbox/checkpoints.py writes tiny
ones), set up as SGLang's `bench_one_batch` sets one up (sglang/benchmark/one_batch.py `load_model`): ServerArgs
resolved and published for the scheduler role, the process-wide MoE / GEMM configs, `bootstrap.init_parallel_runtime`
(a gloo world of one), `ModelRunner(...)` (get_model() -> DefaultModelLoader -> the model class's load_weights ->
process_weights_after_loading, with the plugin's hooks engaged), the KV pools and the attention backend
(`torch_native`). Forward passes go through `ScheduleBatch` / `ForwardBatch` exactly like bench_one_batch's
`extend` / `decode`; greedy sampling is SGLang's sampler.

RL flows call the runner's `WeightUpdater` with what SGLang's scheduler hands it (managers/scheduler_components/
weight_updater.py): tensors are serialized with SGLang's MultiprocessingSerializer and deserialized as the
scheduler's `deserialize_own_rank` does; tensor and distributed updates run inside a begin/end weight-update session
(the 0.5.23 scheduler refuses them outside one); `end_weight_update(run_post_load=...)` gets the scheduler's value.

Every SGLang model class needs a platform the CPU box is not: the process fakes an SM100 platform (runtime.py) and
applies the same-math stand-ins (standins.py). Emulated kernels: SGLANG_TRTLLM_MOE_EMULATE=1 (set by `init`).

Release support: releases.py MODEL_RUNNER_RELEASES (the bench_one_batch flow above). Older releases
spell publishing, bootstrap and the runner differently; they raise NotImplementedError naming the release.
"""

from __future__ import annotations

import contextlib
import os
from array import array

import torch

from .releases import MODEL_RUNNER_RELEASES

_STATE: dict = {}

DEFAULT_SERVER_ARGS = dict(
    # "auto": on the faked SM100 the backend is what SGLang resolves with the plugin's auto-selection (the tests
    # compare it with `explain` and assert every FusedMoE layer got it)
    device="cpu",
    attention_backend="torch_native",
    moe_runner_backend="auto",
    # a faked SM100 otherwise picks the cutedsl BF16 GEMM, which imports cuda.bindings
    bf16_gemm_backend="torch",
    disable_cuda_graph=True,
    mem_fraction_static=0.5,
    max_total_tokens=4096,
    max_running_requests=16,
    chunked_prefill_size=-1,
    random_seed=0,
    log_level="error",
    # bench_one_batch's flow allocates without the radix tree; for Nemotron-H it also avoids the Mamba cache
    # snapshots the faked platform would promise (arg_groups/mamba_hook.py validate_mamba_extra_buffer)
    disable_radix_cache=True,
)


#: what the harnesses add for rollout routing replay (R3): SGLang's routed-experts capturer on. With chunked prefill
#: off (DEFAULT_SERVER_ARGS' -1) SGLang sizes the capturer's device buffer from max_running_requests alone
#: (state_capturer/routed_experts.py), which a prefill of more tokens than that overflows: chunked prefill on
ROUTED_EXPERTS_ARGS = dict(enable_return_routed_experts=True, chunked_prefill_size=4096)


def _release():
    from .runtime import release

    return release()


def _server_args(model_dir: str, **overrides):
    from sglang.srt.server_args import ServerArgs

    kw = {**DEFAULT_SERVER_ARGS, **overrides}
    sa = ServerArgs(model_path=model_dir, **kw)
    sa.resolve_once()
    return sa


#: torch intra-op threads of a harness process (SGLANG_TRTLLM_MOE_TEST_THREADS; default 1). The tiny models are
#: far below where threads pay off, and on a small shared box OpenMP's spinning workers make every op wait for a
#: core: a tiny checkpoint took 4.8 s with 2 threads on a loaded 2-core box, 0.22 s with one.
ENV_THREADS = "SGLANG_TRTLLM_MOE_TEST_THREADS"


def threads() -> int:
    return max(1, int(os.environ.get(ENV_THREADS, "1")))


def prepare_process(preload: bool = False, runner: bool = True) -> None:
    """What every harness process needs before SGLang builds a model, once: emulated kernels
    (SGLANG_TRTLLM_MOE_EMULATE=1), `threads()` torch threads, the stand-ins, SGLang's plugins (this plugin among
    them) and a faked SM100. `preload`: also import the modules a model build and the checks import (a parent that
    forks one child per model pays the imports once). `runner=False`: a process that builds no ModelRunner itself
    (sglang.Engine's launcher: its scheduler builds one the release's own way), so any release."""
    if _STATE.get("prepared"):
        return
    if runner and _release() not in MODEL_RUNNER_RELEASES:
        raise NotImplementedError(
            f"sandbox.models spells SGLang's runner set-up for {MODEL_RUNNER_RELEASES} (bench_one_batch flow); "
            f"this is SGLang {_release()}"
        )
    os.environ.setdefault("SGLANG_TRTLLM_MOE_EMULATE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads()))
    torch.set_num_threads(threads())
    from . import activation, standins

    standins.apply(with_sglang=False)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    activation.activate()
    _STATE["prepared"] = True
    if preload:
        import importlib

        for mod in (
            "sglang.benchmark.one_batch",
            "sglang.srt.model_executor.model_runner",
            "sglang.srt.model_loader",
            "sglang.srt.models.registry",
            "sglang.srt.utils.weight_checker",
            "sglang.srt.weight_sync.tensor_bucket",
            "sglang.srt.layers.quantization.modelopt_quant",
            "sglang.srt.layers.quantization.fp8",
            "sglang_trtllm_moe.explain",
            "transformers",
            "safetensors.torch",
        ):
            importlib.import_module(mod)
        from sglang.srt.models.registry import ModelRegistry

        ModelRegistry.get_supported_archs()  # imports every model class once (what get_model_architecture does)


def init(model_dir: str, **server_args) -> None:
    """Once per process: `prepare_process()`, then ServerArgs published for the scheduler role, MoE / GEMM configs
    and the parallel runtime (SGLang's bench_one_batch `correctness_test` + `load_model` prologue)."""
    if _STATE.get("init"):
        return
    prepare_process()
    from sglang.benchmark import one_batch
    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish
    from sglang.srt.server_args import PortArgs

    sa = _server_args(model_dir, **server_args)
    port_args = PortArgs.init_new(sa)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    if hasattr(one_batch, "_init_process_global_configs"):  # 0.5.22+
        one_batch._init_process_global_configs()
    else:  # 0.5.21: the same initializers, called by its latency_test (correctness_test forgets the MoE one)
        _init_global_configs_0_5_21()
    bootstrap.init_parallel_runtime(server_args=sa, device=get_device().device, dist_port=port_args.nccl_port)
    _STATE.update(init=True, server_args=sa, port_args=port_args, extra=dict(server_args))


def _init_global_configs_0_5_21() -> None:
    import importlib

    from sglang.srt.layers.moe import initialize_moe_config

    initialize_moe_config()
    for mod, fn in (
        ("sglang.srt.layers.quantization.fp8_utils", "initialize_fp8_gemm_config"),
        ("sglang.srt.layers.quantization.bf16_utils", "initialize_bf16_gemm_config"),
        ("sglang.srt.layers.quantization.fp4_utils", "initialize_fp4_gemm_config"),
    ):
        try:
            getattr(importlib.import_module(mod), fn)()
        except (ImportError, AttributeError):
            pass


def server_args():
    """The ServerArgs `init` published for this process (what every model of it is built with)."""
    return _STATE["server_args"]


def moe_layers(model) -> dict[str, torch.nn.Module]:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class TinyModel:
    """SGLang's ModelRunner for `model_dir`, plus the RL entry points as the scheduler calls them."""

    def __init__(self, model_dir: str, **server_args):
        init(model_dir, **server_args)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.model_executor.model_runner import ModelRunner

        sa = _STATE["server_args"]
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_server_args(sa, model_path=model_dir)
        bootstrap.init_layer_runtime(model_config=self.model_config)
        self.runner = ModelRunner(
            model_config=self.model_config,
            mem_fraction_static=sa.mem_fraction_static,
            gpu_id=0,
            nccl_port=_STATE["port_args"].nccl_port,
            server_args=sa,
        )
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()
        self._session: dict | None = None

    # ---- the model ----------------------------------------------------------------------------------------------

    @property
    def model(self):
        return self.runner.model

    @property
    def updater(self):
        return self.runner.weight_updater

    def moe_layers(self) -> dict[str, torch.nn.Module]:
        return moe_layers(self.model)

    def pointers(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}

    def state_bytes(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model, as bytes (a copy)."""
        out = {n: _bytes(p).clone() for n, p in self.model.named_parameters()}
        out.update({f"buffer:{n}": _bytes(b).clone() for n, b in self.model.named_buffers()})
        return out

    def fresh(self, model_dir: str):
        """A fresh model of `model_dir` from SGLang's `get_model()` (model_loader/__init__.py), with this runner's
        load config: what a new server would load. (One ModelRunner per process: SGLang's expert-location metadata
        is process-global.) Run it with `generate(..., model=...)`."""
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader import get_model

        mc = ModelConfig.from_server_args(_STATE["server_args"], model_path=model_dir)
        return get_model(model_config=mc, load_config=self.runner.load_config, device_config=DeviceConfig("cpu", 0))

    def differences(self, other) -> list[str]:
        """Names of parameters (and buffers) whose bytes differ from `other`'s (a model, e.g. `fresh(...)`)."""
        other = other.model if isinstance(other, TinyModel) else other
        mine, theirs = dict(self.model.named_parameters()), dict(other.named_parameters())
        mine.update({f"buffer:{n}": b for n, b in self.model.named_buffers()})
        theirs.update({f"buffer:{n}": b for n, b in other.named_buffers()})
        if set(mine) != set(theirs):
            return sorted(set(mine) ^ set(theirs))
        return [
            n
            for n in mine
            if mine[n].dtype != theirs[n].dtype
            or mine[n].shape != theirs[n].shape
            or not torch.equal(_bytes(mine[n]), _bytes(theirs[n]))
        ]

    # ---- forward (bench_one_batch's extend / decode) ------------------------------------------------------------

    def _reqs(self, prompts, max_new_tokens):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        reqs = []
        for i, p in enumerate(prompts):
            r = Req(
                rid=str(i),
                origin_input_text="",
                origin_input_ids=array("q", p),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
            )
            r.full_untruncated_fill_ids = r.origin_input_ids
            r.logprob_start_len = -1
            if hasattr(r, "set_extend_range"):  # 0.5.21 (bench_one_batch's prepare_inputs_for_correctness_test)
                r.set_extend_range(len(r.prefix_indices), len(r.origin_input_ids))
            else:
                r.extend_end = len(r.origin_input_ids)
            reqs.append(r)
        return reqs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 4, model=None):
        """Greedy generation through SGLang's ScheduleBatch / ForwardBatch / sampler. Returns (tokens per prompt,
        the prefill's next-token logits [len(prompts), vocab] float32). `model`: run another model of the same
        architecture (e.g. `fresh(...)`) on this runner's pools and attention backend instead."""
        if model is not None:
            own, self.runner.model = self.runner.model, model
            try:
                return self.generate(prompts, max_new_tokens)
            finally:
                self.runner.model = own
        from sglang.benchmark import one_batch

        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        reqs = self._reqs(prompts, max_new_tokens)
        next_ids, logits, batch = one_batch.extend(reqs, self.runner)
        out = [[t] for t in next_ids.tolist()]
        first_logits = logits.float().clone()
        for _ in range(max_new_tokens - 1):
            next_ids, _ = one_batch.decode(next_ids, batch, self.runner)
            for o, t in zip(out, next_ids.tolist(), strict=True):
                o.append(t)
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        return out, first_logits

    @torch.no_grad()
    def generate_routed(self, prompts: list[list[int]], max_new_tokens: int = 4, model=None, after_forward=None):
        """`generate`, reading SGLang's routed-experts capturer after every forward (the runner built with
        ROUTED_EXPERTS_ARGS). Returns (tokens per prompt, routed experts per prompt: [prompt_len + max_new_tokens
        - 1][num_hidden_layers][top_k], what a server answers in meta_info["routed_experts"]). `after_forward(
        buffer, tokens)` runs after each forward with SGLang's device buffer and the number of rows it filled."""
        if model is not None:
            own, self.runner.model = self.runner.model, model
            try:
                return self.generate_routed(prompts, max_new_tokens, after_forward=after_forward)
            finally:
                self.runner.model = own
        from sglang.benchmark import one_batch

        from ..compat import routed_experts

        cap = routed_experts.capturer()
        if cap is None:
            raise RuntimeError("no routed-experts capturer: build the TinyModel with ROUTED_EXPERTS_ARGS")
        buffer = cap.device_cache.buffer
        k = getattr(cap, "topk_size", buffer.shape[2])

        def forward(run, rows: int) -> tuple:
            buffer.zero_()
            result = run()
            if after_forward is not None:
                after_forward(buffer, rows)
            return result, buffer[:rows, :, :k].tolist()

        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()
        try:
            reqs = self._reqs(prompts, max_new_tokens)
            (next_ids, _, batch), rows = forward(
                lambda: one_batch.extend(reqs, self.runner), sum(len(p) for p in prompts)
            )
            routed: list[list] = []
            start = 0
            for p in prompts:
                routed.append(rows[start : start + len(p)])
                start += len(p)
            out = [[t] for t in next_ids.tolist()]
            for _ in range(max_new_tokens - 1):
                ids = next_ids
                (next_ids, _), rows = forward(lambda ids=ids: one_batch.decode(ids, batch, self.runner), len(prompts))
                for r, row, o, t in zip(routed, rows, out, next_ids.tolist(), strict=True):
                    r.append(row)
                    o.append(t)
            return out, routed
        finally:
            self.runner.req_to_token_pool.clear()
            self.runner.token_to_kv_pool_allocator.clear()

    # ---- RL entry points, as SGLang's scheduler calls the runner's WeightUpdater ----------------------------------

    @torch.no_grad()
    def update_from_disk(self, path: str, load_format: str = "auto"):
        ok, msg = self.updater.update_weights_from_disk(path, load_format)
        if not ok:
            raise RuntimeError(msg)
        return msg

    @torch.no_grad()
    def begin(self) -> None:
        if self._session is not None:
            raise RuntimeError("a weight-update session is already open")
        self.updater.begin_weight_update()
        self._session = {"loaded_weights": False}

    @torch.no_grad()
    def end(self) -> None:
        if self._session is None:
            raise RuntimeError("no weight-update session is open")
        run_post_load = not self._session["loaded_weights"]
        self._session = None
        self.updater.end_weight_update(run_post_load=run_post_load)

    @contextlib.contextmanager
    def session(self):
        self.begin()
        try:
            yield self
        finally:
            self.end()

    def _in_session(self, fn):
        own = self._session is None
        if own:
            self.begin()
        try:
            ok, msg = fn()
            if not ok:
                raise RuntimeError(msg)
            assert self._session is not None  # begin() opened it
            self._session["loaded_weights"] = True
        finally:
            if own:
                self.end()
        return msg

    @torch.no_grad()
    def update_from_tensor(self, named_tensors, load_format: str | None = None):
        """Engine.update_weights_from_tensor -> scheduler: serialized with MultiprocessingSerializer, deserialized for
        this rank, handed to WeightUpdater.update_weights_from_tensor (inside a session, opened here if none is).
        `load_format="flattened_bucket"`: `named_tensors` is grouped into one FlattenedTensorBucket (as RL
        frameworks send buckets)."""
        # The Engine serializes with MultiprocessingSerializer and the scheduler deserializes the same tensors; the
        # round trip is skipped here (in one process it would hand the same tensors back); the Engine, HTTP server
        # and verl tests make it across real processes.
        payload = flattened_bucket(named_tensors) if load_format == "flattened_bucket" else list(named_tensors)
        return self._in_session(lambda: self.updater.update_weights_from_tensor(payload, load_format=load_format))

    @torch.no_grad()
    def load_distributed(self, named_tensors):
        """The load half of update_weights_from_distributed (what the scheduler passes after the receive)."""
        return self._in_session(lambda: self.updater.load_weights_from_distributed(list(named_tensors)))


def flattened_bucket(named_tensors) -> dict:
    """What an RL framework sends for load_format="flattened_bucket": SGLang's FlattenedTensorBucket of the tensors,
    as {"flattened_tensor", "metadata"}."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=list(named_tensors))
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def buckets(named_tensors, n: int):
    """Split a list of (name, tensor) into `n` consecutive buckets (a layer's tensors may span two buckets)."""
    items = list(named_tensors)
    size = -(-len(items) // n)
    return [items[i : i + size] for i in range(0, len(items), size)]
