"""Stand up SGLang's process-level state on a CPU box, per release, so real layers can be built and run.

SGLang's FusedMoE and quant methods read a published ServerArgs, model-parallel groups and the platform. A test,
the demo or the benchmark needs that state in one process without a GPU: gloo world of size 1, a faked Blackwell
platform (the quant methods refuse NVFP4 elsewhere), and the MoE config initialised from the chosen backend.
How each step is spelled changed between releases (read from the wheels: `runtime_context` exists from 0.5.14,
`override_platform` from 0.5.19, `SpawnRanks` from 0.5.21), so each step asks a flag of compat/features.py:

- fake SM100: < 0.5.19 rebind `is_sm100_supported` / `is_blackwell_supported` (lru-cached module globals, imported
  by name into ~10 modules); >= 0.5.19 `runtime_context.override_platform(...).install()`
- publish ServerArgs: < 0.5.21 `set_global_server_args_for_scheduler` (a global ≤ 0.5.15,
  `get_context().set_server_args` 0.5.16–0.5.17, `publish(role="scheduler")` 0.5.18, the same shim (`publish`)
  0.5.19–0.5.20); >= 0.5.21 `publish(..., ranks=SpawnRanks(0))` + `get_parallel().override_permanently(world_group=...)`
- MoE config: < 0.5.19 `initialize_moe_config(server_args)`; >= 0.5.19 `initialize_moe_config()`
- weight updates: < 0.5.16 `ModelRunner.update_weights_from_{disk,tensor}`; >= 0.5.16 `WeightUpdater`

One CPU-only repair: up to 0.5.19 NVFP4 `create_weights` calls `quantization.utils.swizzle_blockscale`, which ends in
`.contiguous().cuda()` (for a shape-only placeholder), so no NVFP4 layer can even be built without a GPU. On a box
without CUDA, SGLang's own function is kept and only its `.cuda()` is made a no-op for the duration of that call.
"""

from __future__ import annotations

import os
import sys

from packaging.version import Version

from ..compat import features

_INITIALISED: dict = {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release() -> Version:
    from ..compat.releases import installed_version

    v = installed_version()
    if v is None:
        raise RuntimeError("sglang is not installed")
    return Version(v.base_version)


def _rebind_everywhere(module, name: str, new) -> None:
    original = getattr(module, name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("sglang") and getattr(mod, name, None) is original:
            setattr(mod, name, new)


def keep_swizzle_on_cpu() -> None:
    """SGLang's `swizzle_blockscale` without its hard-coded `.cuda()` (only where CUDA is absent)."""
    import functools
    import unittest.mock

    import torch
    from sglang.srt.layers.quantization import utils as qutils

    original = qutils.swizzle_blockscale
    if getattr(original, "_trtllm_moe_cpu", False):
        return

    @functools.wraps(original)
    def swizzle_blockscale(scale):
        with unittest.mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
            return original(scale)

    vars(swizzle_blockscale)["_trtllm_moe_cpu"] = True
    _rebind_everywhere(qutils, "swizzle_blockscale", swizzle_blockscale)


def _publish(server_args) -> None:
    from sglang.srt.distributed import parallel_state

    if features.PUBLISH_WITH_RANKS.present():
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

        reset_context()
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    else:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(server_args)


def init_single_process(moe_runner_backend: str = "flashinfer_trtllm", port: int | None = None, **server_args) -> None:
    """Idempotent per backend: re-publishing the config switches backend for layers built afterwards."""
    key = (moe_runner_backend, tuple(sorted(server_args.items())))
    if _INITIALISED.get("key") == key:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # The rendezvous port goes to init only, not into os.environ: child processes (tests that start SGLang in a
    # subprocess) inherit the environment and would try to listen on the port this process holds.
    port = port or int(os.environ.get("MASTER_PORT") or _free_port())
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)

    import torch
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.server_args import ServerArgs

    if not _INITIALISED.get("platform"):
        from ..compat.fake_platform import fake_blackwell

        fake_blackwell()
        if features.SWIZZLE_MOVES_TO_CUDA.present() and not torch.cuda.is_available():
            import sglang.srt.layers.quantization.modelopt_quant  # noqa: F401  (binds the name first)

            keep_swizzle_on_cpu()
        _INITIALISED["platform"] = True
    if not torch.distributed.is_initialized():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
    sa = ServerArgs(
        model_path="dummy",
        device="cpu",
        tp_size=1,
        ep_size=1,
        pp_size=1,
        moe_runner_backend=moe_runner_backend,
        **server_args,
    )
    _publish(sa)
    if not model_parallel_is_initialized():
        initialize_model_parallel(backend="gloo")
    elif features.PUBLISH_WITH_RANKS.present():
        _republish_groups()  # re-publishing (another backend) reset the context: the groups built before stay valid
    if features.MOE_CONFIG_TAKES_ARGS.present():
        initialize_moe_config(sa)
    else:
        initialize_moe_config()
    _INITIALISED["key"] = key


def _republish_groups() -> None:
    """What initialize_model_parallel writes into the runtime context (0.5.21+), for groups already built."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    built = {
        "tp_group": "_TP",
        "pp_group": "_PP",
        "moe_ep_group": "_MOE_EP",
        "moe_dp_group": "_MOE_DP",
        "moe_tp_group": "_MOE_TP",
        "attn_tp_group": "_ATTN_TP",
        "attn_cp_group": "_ATTN_CP",
        "shared_experts_tp_group": "_SHARED_EXPERTS_TP",
        "dcp_group": "_DCP",
    }
    groups = {k: getattr(ps, v, None) for k, v in built.items()}
    get_parallel().override_permanently(**{k: g for k, g in groups.items() if g is not None})


def weight_updater(model, model_config):
    """The object that owns `update_weights_from_disk` / `update_weights_from_tensor` in this release, around
    `model`, as a server's scheduler would call it (SGLang's own code, with the plugin's hooks on it).

    >= 0.5.16: a `WeightUpdater` component. Before: those are `ModelRunner` methods; a `ModelRunner` shell (no
    __init__: that would load a model and allocate KV caches) carries exactly the fields they read."""
    from types import SimpleNamespace

    if features.WEIGHT_UPDATER.present():
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        # 0.5.17-0.5.20 refuse updates unless the runner's --weight-cache-mode is "off"; later releases do not ask
        runner = None
        if features.WEIGHT_CACHE_CHECK.present():
            runner = SimpleNamespace(server_args=SimpleNamespace(weight_cache_mode="off"))
        return WeightUpdater(
            tp_rank=0,
            device="cpu",
            gpu_id=0,
            model_config=model_config,
            custom_weight_loaders={},
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
        server_args=SimpleNamespace(model_path=model_config.model_path, load_format="auto", custom_weight_loader=[]),
    )
    return runner


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

    if not (features.WEIGHT_CHECKER_TAKES_PS.present() or features.WEIGHT_CHECKER_OF_MODEL_RUNNER.present()):
        return WeightChecker(get_model=lambda: model)

    class _RoleAccepted(WeightChecker):
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


__all__ = ["weight_checker", "weight_updater", "init_single_process", "keep_swizzle_on_cpu", "release"]


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
    Needs a release that publishes per-rank placement (`runtime_context.SpawnRanks`, >= 0.5.21)."""
    try:
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, override_platform, publish, reset_context
    except ImportError as e:
        raise NotImplementedError(
            f"init_rank needs an SGLang release with runtime_context.SpawnRanks (>= 0.5.21): {e}"
        ) from e
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

    if not _INITIALISED.get("platform"):
        override_platform(is_blackwell=True, is_sm100=True).install()
        _INITIALISED["platform"] = True
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
    _INITIALISED["key"] = ("rank", rank, world_size, tp_size, ep_size, moe_runner_backend)


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
