"""Stand up SGLang's process-level state on a CPU box, per release, so real layers can be built and run.

SGLang's FusedMoE and quant methods read a published ServerArgs, model-parallel groups and the platform. A test,
the demo or the benchmark needs that state in one process without a GPU: gloo world of size 1, a faked Blackwell
platform (the quant methods refuse NVFP4 elsewhere), and the MoE config initialised from the chosen backend.
How each step is spelled changed between releases (read from the wheels: `runtime_context` exists from 0.5.14,
`override_platform` from 0.5.19, `SpawnRanks` from 0.5.21), so each step asks a flag (releases.py; the
platform: activation.py):

- fake SM100: < 0.5.19 rebind `is_sm100_supported` / `is_blackwell_supported` (lru-cached module globals, imported
  by name into ~10 modules); >= 0.5.19 `runtime_context.override_platform(...).install()`
- publish ServerArgs: < 0.5.21 `set_global_server_args_for_scheduler` (a global ≤ 0.5.15,
  `get_context().set_server_args` 0.5.16–0.5.17, `publish(role="scheduler")` 0.5.18, the same shim (`publish`)
  0.5.19–0.5.20); >= 0.5.21 `publish(..., ranks=SpawnRanks(0))` + `get_parallel().override_permanently(world_group=...)`
- MoE config: < 0.5.19 `initialize_moe_config(server_args)`; >= 0.5.19 `initialize_moe_config()`

The test fixtures built on it (SGLang's weight updater and weight checker around a model, a rank of a multi-process
world) are tests/support/sglang_runtime.py's.

One CPU-only repair: up to 0.5.19 NVFP4 `create_weights` calls `quantization.utils.swizzle_blockscale`, which ends in
`.contiguous().cuda()` (for a shape-only placeholder), so no NVFP4 layer can even be built without a GPU. On a box
without CUDA, SGLang's own function is kept and only its `.cuda()` is made a no-op for the duration of that call.
"""

from __future__ import annotations

import os

from packaging.version import Version

from . import releases

_INITIALISED: dict = {}


def free_port() -> int:
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


def keep_swizzle_on_cpu() -> None:
    """SGLang's `swizzle_blockscale` without its hard-coded `.cuda()` (only where CUDA is absent): the CPU sandbox's
    stand-in (standins.py), which the Engine's spawned scheduler gets from register()."""
    from .standins import nvfp4_placeholder_swizzle_on_cpu

    nvfp4_placeholder_swizzle_on_cpu()


def _publish(server_args) -> None:
    from sglang.srt.distributed import parallel_state

    if releases.PUBLISH_WITH_RANKS.present():
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

        reset_context()
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    else:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(server_args)


def fake_platform_once() -> None:
    """For the rest of the process SGLang sees an SM100 GPU (activation.fake_blackwell), and NVFP4
    `create_weights` runs without one where the release needs it (`keep_swizzle_on_cpu`); once per process."""
    if _INITIALISED.get("platform"):
        return
    import torch

    from .activation import fake_blackwell

    fake_blackwell()
    if releases.SWIZZLE_MOVES_TO_CUDA.present() and not torch.cuda.is_available():
        keep_swizzle_on_cpu()
    _INITIALISED["platform"] = True


def init_single_process(moe_runner_backend: str = "flashinfer_trtllm", port: int | None = None, **server_args) -> None:
    """Idempotent per backend: re-publishing the config switches backend for layers built afterwards."""
    key = (moe_runner_backend, tuple(sorted(server_args.items())))
    if _INITIALISED.get("key") == key:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # The rendezvous port goes to init only, not into os.environ: child processes (tests that start SGLang in a
    # subprocess) inherit the environment and would try to listen on the port this process holds.
    port = port or int(os.environ.get("MASTER_PORT") or free_port())
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

    fake_platform_once()
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
    elif releases.PUBLISH_WITH_RANKS.present():
        _republish_groups()  # re-publishing (another backend) reset the context: the groups built before stay valid
    if releases.MOE_CONFIG_TAKES_ARGS.present():
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


__all__ = ["fake_platform_once", "free_port", "init_single_process", "keep_swizzle_on_cpu", "release"]
