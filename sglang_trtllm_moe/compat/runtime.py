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
