"""Stand up SGLang's process-level state on a CPU box, per release, so real layers can be built and run.

SGLang's FusedMoE and quant methods read a published ServerArgs, model-parallel groups and the platform. A test,
the demo or the benchmark needs that state in one process without a GPU: gloo world of size 1, a faked Blackwell
platform (the quant methods refuse NVFP4 elsewhere), and the MoE config initialised from the chosen backend.
How each step is spelled changed between releases (cpu-test-environment.md §3), hence this module.
"""

from __future__ import annotations

import os

_INITIALISED: dict = {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(moe_runner_backend: str = "flashinfer_trtllm", port: int | None = None, **server_args) -> None:
    """Idempotent per backend: re-publishing the config switches backend for layers built afterwards."""
    key = (moe_runner_backend, tuple(sorted(server_args.items())))
    if _INITIALISED.get("key") == key:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port or _free_port()))  # concurrent test runs must not collide
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)

    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, override_platform, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if not _INITIALISED.get("platform"):
        override_platform(is_blackwell=True, is_sm100=True).install()
        _INITIALISED["platform"] = True
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu", tp_size=1, ep_size=1, pp_size=1,
                   moe_runner_backend=moe_runner_backend, **server_args),
        role="test", ranks=SpawnRanks(world_rank=0),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    if not model_parallel_is_initialized():
        initialize_model_parallel(backend="gloo")
    initialize_moe_config()
    _INITIALISED["key"] = key


def init_rank(rank: int, world_size: int, tp_size: int, ep_size: int, port: int,
              moe_runner_backend: str = "flashinfer_trtllm", timeout: int | None = 300, **server_args) -> None:
    """One rank of a multi-process CPU world, set up the way SGLang's scheduler does it (0.5.23
    `bootstrap._init_parallel_groups`): a gloo world over TCP, the rank's ServerArgs published with its
    `SpawnRanks(world_rank)` (SGLang derives tp / moe-ep / moe-tp ranks from it), then the model-parallel groups.

    Multi-rank bugs (TP-split intermediate sizes, EP expert offsets) only show when every rank builds and loads
    its own shard, so tests run this in each of N processes. Calling it again in the same process with another
    (tp_size, ep_size) over the same world tears the model-parallel groups down and rebuilds them, so one process
    group can cover several layouts (starting processes that import SGLang is the expensive part on CPU).
    Needs a release that publishes per-rank placement (`runtime_context.SpawnRanks`, >= 0.5.22)."""
    try:
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, override_platform, publish, reset_context
    except ImportError as e:
        raise NotImplementedError(f"init_rank needs an SGLang release with runtime_context.SpawnRanks (>= 0.5.22): {e}")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", str(rank)),
                 ("WORLD_SIZE", str(world_size)), ("LOCAL_RANK", str(rank))):
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
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=timeout)
    if model_parallel_is_initialized():
        _destroy_model_parallel(destroy_model_parallel)
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu", tp_size=tp_size, ep_size=ep_size, pp_size=1,
                   moe_runner_backend=moe_runner_backend, **server_args),
        role="test", ranks=SpawnRanks(world_rank=rank),
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
    stub.reset_parallel_initialised = lambda: None
    sys.modules[name] = stub
    try:
        return destroy()
    finally:
        if sys.modules.get(name) is stub:
            del sys.modules[name]
