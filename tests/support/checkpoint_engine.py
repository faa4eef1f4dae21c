"""checkpoint-engine's side of SGLang's `update_weights_from_ipc`, on a CPU: its worker loop, its transport stood in.

checkpoint-engine (MoonshotAI) updates SGLang through `WeightUpdater.update_weights_from_ipc`, which builds SGLang's
own `SGLangCheckpointEngineWorkerExtensionImpl` (sglang/srt/checkpoint_engine/checkpoint_engine_worker.py) and calls
`checkpoint_engine.worker.update_weights_from_ipc(ctx, handle, device_id, run=model.load_weights,
post_hook=...)`. That loop (checkpoint-engine 0.4.x `worker.py`): receive one IPC buffer, then one bucket of
(name, shape, dtype, offset) metadata at a time, each handed to `run` as views of the buffer (two halves, reused
every other bucket); a bucket whose `run` raises answers its traceback to the parameter server, which then sends a
RuntimeError the worker raises (ps.py: "Some workers failed to update weights"); after the last bucket, `None`: the
worker calls `post_hook` (SGLang's: `process_weights_after_loading` of every module, then `post_load_weights`).

The package itself cannot run here: its `DeviceManager()` raises TypeError without CUDA or an NPU, and the buffer is
a CUDA IPC handle. `installed(server)` puts a `checkpoint_engine.worker` module into `sys.modules` whose
`update_weights_from_ipc` replays that loop against `server` (a `ParameterServer` of this module) in place of the ZMQ
socket and the CUDA buffer, and SGLang's extension gets the answers a GPU process gives it: a device uuid (it keys
the ZMQ handle by it) and the device its post hook prepares on. A CPU-only process without SGLang's CPU engine has
neither: `DeviceMixin.get_device_uuid` raises NotImplementedError, and `utils.get_device()` raises "No accelerator",
which the post hook catches and logs as a warning, skipping every `process_weights_after_loading`; here it is told
"cpu" (device 0), where SGLang's `device_loading_context` moves nothing, as on a GPU whose weights are on it. Before
0.5.20 the extension asks `torch.cuda` itself (`current_device()`, `get_device_properties(i).uuid`, and
`torch.device("cuda", i)` for its post hook): the module's own `torch` is then a view of torch that answers those the
same way (`_CudaAnswers`), the rest of torch unchanged.
Everything from SGLang's entry point down (its worker extension, the model's `load_weights`, its post hook, the
plugin's hooks) is the real code of the installed release.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import traceback
import types

import torch


class ParameterServer:
    """The trainer's side: `buckets` (lists of (name, tensor)) sent in order through one reused uint8 buffer."""

    def __init__(self, buckets: list):
        self.buckets = [list(b) for b in buckets]
        half = max(sum(_nbytes(t) for _, t in b) for b in self.buckets)
        self.half = half
        self.buffer = torch.zeros(2 * half, dtype=torch.uint8)
        self.replies: list[str] = []  # "" per bucket loaded, else the worker's traceback
        self.post_hook_ran = False

    def _stage(self, index: int) -> list:
        """Bucket `index` copied into its half of the buffer: the metadata the worker receives."""
        offset, metas = (index % 2) * self.half, []
        for name, t in self.buckets[index]:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self.buffer[offset : offset + raw.numel()].copy_(raw)
            metas.append({"name": name, "shape": t.shape, "dtype": t.dtype, "offset": offset})
            offset += raw.numel()
        return metas

    def serve(self, run, post_hook) -> None:
        """checkpoint-engine's worker loop with this server at the other end of the socket."""
        for i in range(len(self.buckets)):
            try:
                run(_extract(self._stage(i), self.buffer))
                self.replies.append("")
            except Exception as e:  # noqa: BLE001 - the worker answers the traceback, the server decides
                self.replies.append("".join(traceback.format_exception(type(e), e, e.__traceback__)))
                raise RuntimeError("Some workers failed to update weights") from None
        if post_hook is not None:
            post_hook()
            self.post_hook_ran = True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _extract(metas: list, buffer: torch.Tensor) -> list:
    """checkpoint-engine's `_extract_weights`: views of the shared buffer, not copies."""
    out = []
    for m in metas:
        size = m["dtype"].itemsize * m["shape"].numel()
        out.append((m["name"], buffer[m["offset"] : m["offset"] + size].view(dtype=m["dtype"]).view(m["shape"])))
    return out


class _Device:
    """What `get_device_module()` is asked here: the current device's index."""

    @staticmethod
    def current_device() -> int:
        return 0


class _CudaAnswers:
    """torch, as the checkpoint-engine extension of releases before 0.5.20 sees it: device 0 of uuid DEVICE_UUID,
    and "cuda" devices meaning where the weights are (the CPU); everything else is torch's own."""

    class cuda:
        @staticmethod
        def current_device() -> int:
            return 0

        @staticmethod
        def get_device_properties(device_id=0):
            return types.SimpleNamespace(uuid=DEVICE_UUID)

    @staticmethod
    def device(kind, index=None):
        return torch.device("cpu") if str(kind).startswith("cuda") else torch.device(kind, index)

    def __getattr__(self, name):
        return getattr(torch, name)


_SERVERS: list = []  # the server of the innermost `installed` block


def update_weights_from_ipc(zmq_ctx, zmq_handle, device_id, *, run, post_hook=None):
    """`checkpoint_engine.worker.update_weights_from_ipc`, with the current block's server at the other end."""
    _SERVERS[-1].serve(run, post_hook)


@contextlib.contextmanager
def installed(server: ParameterServer):
    """`checkpoint_engine.worker` as SGLang imports it, bound to `server`, and a GPU process's answers to SGLang's
    extension (module docstring), for the duration of the block."""
    pkg = types.ModuleType("checkpoint_engine")
    worker = types.ModuleType("checkpoint_engine.worker")
    # SGLang binds the function by name at its module's first import: it must find the server of each block
    worker.update_weights_from_ipc = update_weights_from_ipc
    pkg.worker = worker
    from sglang.srt.platforms import current_platform

    _SERVERS.append(server)
    saved = {k: sys.modules.get(k) for k in ("checkpoint_engine", "checkpoint_engine.worker")}
    sys.modules.update({"checkpoint_engine": pkg, "checkpoint_engine.worker": worker})
    sgl = importlib.import_module("sglang.srt.checkpoint_engine.checkpoint_engine_worker")
    if hasattr(sgl, "get_device"):  # 0.5.20+: SGLang's device helpers
        answers = {"get_device": lambda device_id=None: "cpu", "get_device_module": lambda: _Device}
    else:  # before: torch.cuda, spelled out
        answers = {"torch": _CudaAnswers()}
    real = {k: getattr(sgl, k) for k in answers}
    vars(sgl).update(answers)
    vars(current_platform)["get_device_uuid"] = lambda device_id=0: DEVICE_UUID
    try:
        yield server
    finally:
        vars(current_platform).pop("get_device_uuid", None)
        vars(sgl).update(real)
        _SERVERS.remove(server)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


#: the uuid the stood-in platform answers (SGLang's extension prefixes "GPU-")
DEVICE_UUID = "cpu-sandbox-0"


def request():
    """The request SGLang's scheduler hands the runner's WeightUpdater: one ZMQ path per device uuid (never opened
    here)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromIPCReqInput

    return UpdateWeightsFromIPCReqInput(zmq_handles={f"GPU-{DEVICE_UUID}": "ipc:///tmp/sglang-trtllm-moe-test-ce"})
