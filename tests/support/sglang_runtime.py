"""Process-wide set-up for tests that drive real SGLang layers in the pytest process, and the fixtures around them.

SGLang loads plugins and publishes its config once per process; `ensure` does both once (SGLang's own
`load_plugins()` runs our `register()` through the entry point, exactly as a server would; the process is stood up
by the sandbox's sglang_trtllm_moe/sandbox/runtime.py). Around a model: the object that owns SGLang's weight-update
entry points on this release (`weight_updater`), SGLang's weight checker (`weight_checker`), a checkpoint directory
(`write_safetensors_checkpoint`); `init_rank` stands up one rank of a multi-process world. What differs per release
here is named in tests/support/releases.py (and compat/features.py where the product needs the same fact)."""

from __future__ import annotations

import contextlib
import os

from sglang_trtllm_moe.compat import features
from sglang_trtllm_moe.sandbox import runtime

from . import releases


def ensure(backend: str = "flashinfer_trtllm") -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    runtime.init_single_process(backend)


def prepared_like_sglang(make_layer, weights, monkeypatch):
    """A layer from `make_layer()` prepared by the plugin — in place: the same Parameter objects, storage and shapes —
    and another from `make_layer()` prepared by SGLang's own code of this release; every parameter named in `weights`
    must hold the same bytes. Returns (ours, upstream)."""
    import torch

    ours = make_layer()
    ptrs = {n: (p.data_ptr(), tuple(p.shape), p) for n, p in ours.named_parameters()}
    ours.quant_method.process_weights_after_loading(ours)
    for n, (ptr, shape, obj) in ptrs.items():
        p = getattr(ours, n)
        assert p is obj and p.data_ptr() == ptr and tuple(p.shape) == shape, n
    upstream = make_layer()
    upstream_process_weights_after_loading(upstream.quant_method, upstream, monkeypatch)
    for n in weights:
        a, b = getattr(ours, n).detach(), getattr(upstream, n).detach()
        assert a.shape == b.shape, (n, a.shape, b.shape)
        same = torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        assert same, f"{n} differs from SGLang's own trtllm preparation"
    return ours, upstream


def upstream_process_weights_after_loading(method, layer, monkeypatch) -> None:
    """SGLang's own NVFP4 trtllm preparation, as an oracle on CPU.

    The hooked method keeps SGLang's original at `__wrapped__`. Its only CUDA-only step is flashinfer's
    `nvfp4_block_scale_interleave`; it is replaced by SGLang's own pure-torch `swizzle_blockscale` (flattened,
    as flashinfer returns it), byte-identical to it (tests/test_layouts.py checks the swizzle against SGLang's).
    """
    import flashinfer
    import torch
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.layers.quantization.utils import swizzle_blockscale

    monkeypatch.setattr(
        flashinfer,
        "nvfp4_block_scale_interleave",
        lambda x: swizzle_blockscale(x.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1),
    )
    original = ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    original(method, layer)


_CONFIG_DIRS: dict = {}


def write_safetensors_checkpoint(path, tensors, spec, named=None) -> None:
    """A model directory SGLang's update_weights_from_disk can read: config.json + model.safetensors of a
    TinyMoeModel (`tensors` below the MoE block, as sandbox.layers' random checkpoints name them; or `named`, full
    checkpoint names, as they are)."""
    import json
    import os

    from safetensors.torch import save_file

    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in (named if named is not None else cpu_layers.checkpoint_names(tensors)).items()},
        os.path.join(path, "model.safetensors"),
    )
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.intermediate,
        "intermediate_size": 4 * spec.hidden,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def updater(model, path=None, runner=None, loaders=()):
    """The object that owns SGLang's weight-update entry points on this release (WeightUpdater, or ModelRunner
    before 0.5.16) around `model`. ModelConfig needs a config.json and must not reach a hub; update_weights_from_tensor
    never reads the directory, so one per format is written once. `runner`: what a WeightUpdater's get_model_runner
    answers (a ModelRunner shell over it: tests/support/spec_worker.py). `loaders`: the import paths of
    --custom-weight-loader (tests/test_custom_loaders.py)."""
    import tempfile

    from sglang.srt.configs.model_config import ModelConfig

    if path is None:
        fmt = model.spec.fmt
        if fmt not in _CONFIG_DIRS:
            _CONFIG_DIRS[fmt] = tempfile.mkdtemp(prefix=f"trtllm-moe-cfg-{fmt}-")
            write_safetensors_checkpoint(_CONFIG_DIRS[fmt], {}, model.spec)
        path = _CONFIG_DIRS[fmt]
    return weight_updater(model, ModelConfig(model_path=path), runner, loaders)


def prepared_model(spec, tensors, cls=None):
    """A TinyMoeModel (or a subclass `cls`, under its own prefix) loaded with `tensors` through SGLang's loader and
    prepared, as after a server's model load."""
    from sglang_trtllm_moe.sandbox import layers as cpu_layers

    cls = cls or cpu_layers.TinyMoeModel
    model = cls(spec)
    model.load_weights({cls.prefix + k: v for k, v in cpu_layers.below_block(tensors).items()}.items())
    model.experts.quant_method.process_weights_after_loading(model.experts)
    return model


def forward(layer, x, logits, bypass: bool = False):
    """A forward through SGLang's own TopK (softmax, renormalize) and FusedMoE layer; returns (output, topk).

    `bypass`: routing in the kernel from the logits (the only routing ModelOptFp8MoEMethod's trtllm apply accepts).
    SGLang builds the bypassed output in TopK.forward_cuda (a CPU box dispatches TopK to forward_native, which always
    materializes); on CPU tensors it is the same code a Blackwell server runs."""
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=2, renormalize=True, layer_id=0)
    if not bypass:
        out = topk(x, logits)
        return layer(x, out), out
    if hasattr(topk, "bind_runner_backend"):  # 0.5.23+; before, forward_cuda reads the global backend
        topk.bind_runner_backend(layer.runner_backend, routing_method_type=layer.routing_method_type)
    out = topk.forward_cuda(x, logits)
    assert type(out).__name__ == "BypassedTopKOutput"
    return layer(x, out), out


def plugin_prepares(monkeypatch, *formats: str) -> None:
    """Make the plugin prepare `formats` even where compat/defer.py leaves them to SGLang (upstream right on this
    release): the plugin's replacement path for those formats — what serves the releases where upstream is wrong —
    stays tested on every release, the newest included. tests/test_defer.py checks the verdicts themselves."""
    from sglang_trtllm_moe.compat import defer

    real = defer.verdict
    monkeypatch.setattr(defer, "verdict", lambda fmt, release=None: None if fmt.name in formats else real(fmt, release))


def weight_updater(model, model_config, runner=None, loaders=()):
    """The object that owns `update_weights_from_disk` / `update_weights_from_tensor` in this release, around
    `model`, as a server's scheduler would call it (SGLang's own code, with the plugin's hooks on it).

    >= 0.5.16: a `WeightUpdater` component. Before: those are `ModelRunner` methods; a `ModelRunner` shell (no
    __init__: that would load a model and allocate KV caches) carries exactly the fields they read."""
    from types import SimpleNamespace

    if features.WEIGHT_UPDATER.present():
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        # 0.5.17-0.5.20 refuse updates unless the runner's --weight-cache-mode is "off"; later releases do not ask
        if releases.WEIGHT_CACHE_CHECK.present():
            runner = runner if runner is not None else SimpleNamespace()
            if getattr(runner, "server_args", None) is None:
                runner.server_args = SimpleNamespace(weight_cache_mode="off")
        return WeightUpdater(
            tp_rank=0,
            device="cpu",
            gpu_id=0,
            model_config=model_config,
            custom_weight_loaders=list(loaders),  # what ModelRunner hands it: ServerArgs.custom_weight_loader
            get_model=lambda: model,
            update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: runner,
        )
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.__dict__.update(
        device="cpu",
        gpu_id=0,
        tp_rank=0,
        model=model,
        model_config=model_config,
        server_args=SimpleNamespace(
            model_path=model_config.model_path, load_format="auto", custom_weight_loader=list(loaders)
        ),
    )
    return runner


@contextlib.contextmanager
def cpu_checksum(action: str):
    """Stand-in (docs/TESTING.md) for a weight-checker `action`: before 0.5.23 the checksum brackets its timing with
    torch.cuda.synchronize(), which a CPU-only torch refuses; nothing is queued on a CPU, so a no-op is the same wait.
    Anything else, or with CUDA: unchanged."""
    import torch

    if action != "checksum" or torch.cuda.is_available():
        yield
        return
    from unittest import mock

    with mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None):
        yield


def weight_checker(model):
    """SGLang's WeightChecker around `model`, as the ModelRunner of this release builds it, callable the 0.5.21+ way.
    Before 0.5.21 it also takes the runner's ParallelState (`ps`, read for the checksum's parallelism info; one CPU
    process is SGLang's own `ParallelState.trivial()`), `handle()` has no keyword-only `role` (the checksum role
    arrived with it), and `_snapshot` takes `param.data.detach().cpu()`: a host copy of GPU weights, but on a CPU
    box the same storage, so the snapshot would follow every later write and no corruption could ever be seen.
    A subclass drops `role` and gives the snapshot its own storage (attributes the plugin's hook set kept); every
    action still runs SGLang's own code. Before 0.5.16 the checker is built around the ModelRunner itself
    (`WeightChecker(model_runner)`, reading `.model` and, for a checksum, the runner's tp/dp/pp ranks and sizes):
    a shell with exactly those fields, one CPU process."""
    import torch
    from sglang.srt.utils.weight_checker import WeightChecker

    class _CpuChecksum(WeightChecker):
        def handle(self, action, *args, **kwargs):
            with cpu_checksum(action):
                return super().handle(action, *args, **kwargs)

    if not (releases.WEIGHT_CHECKER_TAKES_PS.present() or features.WEIGHT_CHECKER_OF_MODEL_RUNNER.present()):
        return _CpuChecksum(get_model=lambda: model)

    class _RoleAccepted(_CpuChecksum):
        _snapshot_tensors: dict[str, torch.Tensor]  # set by WeightChecker._snapshot

        def handle(self, action, *args, role=None, **kwargs):
            return super().handle(action, *args, **kwargs)

        def _snapshot(self):
            out = super()._snapshot()
            copies = {}
            for name, t in self._snapshot_tensors.items():
                c = t.clone()
                c.__dict__.update(t.__dict__)
                copies[name] = c
            self._snapshot_tensors = copies
            return out

    if features.WEIGHT_CHECKER_OF_MODEL_RUNNER.present():
        from types import SimpleNamespace

        runner = SimpleNamespace(model=model, tp_rank=0, tp_size=1, dp_rank=None, dp_size=1, pp_rank=0, pp_size=1)
        return _RoleAccepted(model_runner=runner)
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    return _RoleAccepted(get_model=lambda: model, ps=ParallelState.trivial())


def init_rank(
    rank: int,
    world_size: int,
    tp_size: int,
    ep_size: int,
    port: int,
    moe_runner_backend: str = "flashinfer_trtllm",
    timeout: int | None = 300,
    **server_args,
) -> None:
    """One rank of a multi-process CPU world, set up the way SGLang's scheduler does it (0.5.23
    `bootstrap._init_parallel_groups`): a gloo world over TCP, the rank's ServerArgs published with its
    `SpawnRanks(world_rank)` (SGLang derives tp / moe-ep / moe-tp ranks from it), then the model-parallel groups.

    Multi-rank bugs (TP-split intermediate sizes, EP expert offsets) only show when every rank builds and loads
    its own shard, so tests run this in each of N processes. Calling it again in the same process with another
    (tp_size, ep_size) over the same world tears the model-parallel groups down and rebuilds them, so one process
    group can cover several layouts (starting processes that import SGLang is the expensive part on CPU).
    Needs a release that publishes per-rank placement (releases.SPAWN_RANKS)."""
    if not releases.SPAWN_RANKS.present():
        raise NotImplementedError(
            f"init_rank needs an SGLang release with runtime_context.SpawnRanks ({releases.SPAWN_RANKS.releases})"
        )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

    for k, v in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
        ("RANK", str(rank)),
        ("WORLD_SIZE", str(world_size)),
        ("LOCAL_RANK", str(rank)),
    ):
        os.environ[k] = v

    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.server_args import ServerArgs

    runtime.fake_platform_once()
    if not torch.distributed.is_initialized():
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            timeout=timeout,
        )
    if model_parallel_is_initialized():
        _destroy_model_parallel(destroy_model_parallel)
    reset_context()
    publish(
        ServerArgs(
            model_path="dummy",
            device="cpu",
            tp_size=tp_size,
            ep_size=ep_size,
            pp_size=1,
            moe_runner_backend=moe_runner_backend,
            **server_args,
        ),
        role="test",
        ranks=SpawnRanks(world_rank=rank),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()


def _destroy_model_parallel(destroy) -> None:
    """SGLang's destroy_model_parallel first imports `distributed.bootstrap` (0.5.23) only to reset the launcher's
    init guard; that module pulls in uvicorn/fastapi, which a CPU test env does not install. A process set up by
    init_rank never went through bootstrap, so the guard is already clear: a stand-in module answers the call."""
    import importlib
    import sys
    import types

    name = "sglang.srt.distributed.bootstrap"
    try:
        importlib.import_module(name)
        return destroy()
    except ImportError:
        pass
    stub = types.ModuleType(name)
    vars(stub)["reset_parallel_initialised"] = lambda: None
    sys.modules[name] = stub
    try:
        return destroy()
    finally:
        if sys.modules.get(name) is stub:
            del sys.modules[name]
