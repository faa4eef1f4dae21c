"""Stand-ins for the transports of `--load-format remote_instance` on a CPU (docs/TESTING.md, stand-ins):

* nccl: NCCL needs GPUs. `GlooConnector` is SGLang's `RemoteInstanceConnector` (connector/remote_instance.py) with
  the group built over gloo — the same `init_custom_process_group` call, rank 1 of 2, the same group name — and,
  as the seed's side of that rendezvous, SGLang's own `init_weights_send_group_for_remote_instance(..., backend=
  "gloo")` of the seed's runner in a thread (what the new instance's launcher asks the seed for over HTTP).
  `trigger` stands for `trigger_transferring_weights_request` (an HTTP POST to the seed's
  `/send_weights_to_remote_instance`): it calls the seed runner's own `send_weights_to_remote_instance` in a thread.
  Seed and new instance live in one process (two gloo groups of two ranks each side of the same store).
* transfer_engine: Mooncake's TransferEngine needs RDMA NICs. `InProcessTransferEngine.batch_transfer_sync_read`
  copies each (seed pointer, length) into each (local pointer) with memmove — an RDMA read within one address
  space; `register_memory` registers nothing. The seed's published weight info is SGLang's own
  `register_memory_region_v1(model, engine)` (v2 asks torch.cuda for its allocator's segments), handed to the new
  instance in place of the HTTP GET of `get_remote_instance_transfer_engine_info_per_rank`.
Everything else — which parameters, in which order, by which names, numel and element-size checks, the
post_load_weights call — is SGLang's RemoteInstanceModelLoader / WeightExporter (ModelRunner before 0.5.16) code.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
from types import SimpleNamespace

import torch

from sglang_trtllm_moe.compat import features


def instance_ip() -> str:
    """What SGLang's loader names this host (the group name's part)."""
    return socket.gethostbyname(socket.gethostname())


class InProcessTransferEngine:
    session_id = "in-process:0"

    def register_memory(self, ptr: int, length: int) -> int:
        return 0

    def batch_transfer_sync_read(self, session_id, dst_ptrs, src_ptrs, lengths) -> int:
        assert session_id == self.session_id, session_id
        for dst, src, n in zip(dst_ptrs, src_ptrs, lengths, strict=True):
            ctypes.memmove(dst, src, n)
        return 0


def seed_weight_info(seed_model, engine) -> dict:
    """What a transfer-engine seed publishes: name -> (data_ptr, numel, element_size) of its named_parameters."""
    from sglang.srt.model_loader.remote_instance_weight_loader_utils import register_memory_region_v1

    return register_memory_region_v1(seed_model, engine)


def seed_runner(seed_model):
    """The seed's object that owns send_weights_to_remote_instance on this release (a WeightExporter from 0.5.16, a
    ModelRunner before: a shell carrying the fields those methods read)."""
    if features.WEIGHT_EXPORTER.present():
        from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter

        return WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: "", get_model=lambda: seed_model)
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.__dict__.update(tp_rank=0, tp_size=1, gpu_id=0, model=seed_model, _weights_send_group={})
    return runner


@contextlib.contextmanager
def bytes_over_gloo():
    """gloo cannot broadcast 1-byte float tensors (float8: NVFP4 / FP8 weights and scales); NCCL moves them as the
    bytes they are. For the block, `torch.distributed.broadcast` of such a tensor broadcasts its uint8 view (the
    same storage, the same bytes) — in the seed's process and in the new instance's."""
    import torch.distributed as dist

    real = dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8, torch.bool):
            tensor = tensor.view(torch.uint8)
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast
    try:
        yield
    finally:
        dist.broadcast = real


def _seed_loop(conn, seed_model, port: int) -> None:
    """The seed instance, forked: its runner's own init / send, run when the new instance's stand-ins ask."""
    import os

    torch.set_num_threads(1)
    runner = seed_runner(seed_model)
    code = 1
    try:
        with bytes_over_gloo():
            while True:
                what, arg = conn.recv()
                if what == "init":  # init_weights_send_group_for_remote_instance's group, without its CUDA device
                    from sglang.srt.utils import init_custom_process_group

                    name = f"{arg}_{port}_0"
                    runner._weights_send_group[name] = init_custom_process_group(
                        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=name
                    )
                    conn.send((True, name))
                elif what == "send":
                    conn.send(runner.send_weights_to_remote_instance("127.0.0.1", str(port), arg))
                elif what == "call":  # a function of the seed's model, run in the seed (e.g. open a session)
                    conn.send(arg(seed_model))
                else:
                    break
        code = 0
    finally:
        conn.close()
        os._exit(code)


class Seed:
    """A seed instance in a forked process (its model: the parent's at the fork), and the nccl connector of a new
    instance that boots from it: `connector()` is SGLang's RemoteInstanceConnector over gloo, `trigger` the seed's
    /send_weights_to_remote_instance handler."""

    def __init__(self, seed_model):
        import multiprocessing

        from sglang_trtllm_moe.sandbox.runtime import free_port

        self.port = free_port()
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_seed_loop, args=(child, seed_model, self.port), daemon=True)
        self.proc.start()
        self.sent: list = []

    def ask(self, what: str, arg=None, timeout: float = 120):
        self.conn.send((what, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the seed did not answer {what!r} in {timeout} s")
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(("exit", None))
        self.proc.join(30)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()

    def build_group(self, gpu_id=-1, tp_rank=-1, instance_ip=None, group_rank=1, world_size=2):
        """RemoteInstanceConnector.build_group over gloo; the seed's end (its runner's own init, asked as the new
        instance's launcher asks it over HTTP) at the same time."""
        from sglang.srt.utils import init_custom_process_group

        self.conn.send(("init", f"send_weights_{instance_ip}"))
        self._model_update_group = init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{self.port}",
            world_size=world_size,
            rank=group_rank,
            group_name=f"send_weights_{instance_ip}_{self.port}_{tp_rank}",
        )
        ok = self.conn.recv()
        assert ok[0], ok
        return True, "ok"

    def trigger(self, *args, **kwargs) -> None:
        """trigger_transferring_weights_request: the seed sends (its answer kept in `sent`; SGLang's loader runs
        this in a thread it does not join)."""
        self.sent.append(self.ask("send", f"send_weights_{instance_ip()}"))

    def answer(self, timeout: float = 60):
        """The seed's answer to the send the new instance triggered."""
        import time

        end = time.monotonic() + timeout
        while not self.sent and time.monotonic() < end:
            time.sleep(0.05)
        return self.sent[0] if self.sent else None


def loader(backend: str, tp_rank: int = 0):
    """SGLang's RemoteInstanceModelLoader with the load config a new instance gets (a shell without __init__'s
    argument checks: only `load_config` is read by the two transfer methods)."""
    from sglang.srt.model_loader.loader import RemoteInstanceModelLoader

    out = object.__new__(RemoteInstanceModelLoader)
    out.load_config = SimpleNamespace(
        tp_rank=tp_rank,
        remote_instance_weight_loader_backend=backend,
        remote_instance_weight_loader_seed_instance_ip="127.0.0.1",
        remote_instance_weight_loader_seed_instance_service_port=0,
        remote_instance_weight_loader_send_weights_group_ports=[0],
    )
    out.remote_instance_transfer_engine_weight_info = None
    return out


MODEL_CONFIG = SimpleNamespace(dtype=torch.bfloat16)
DEVICE_CONFIG = SimpleNamespace(gpu_id=0, device="cpu")


def open_session(model) -> bool:
    """In the seed: a weight-update session opens (its MoE layers to checkpoint layout, as begin_weight_update)."""
    from sglang_trtllm_moe import layer_state

    layer_state.unprepare_all(model)
    return layer_state.SESSION["open"]


def seed_state(model) -> dict:
    """In the seed, after a send: its MoE layers' parameters by name and whether each layer is laid out."""
    from sglang_trtllm_moe import layer_state

    out = {}
    for name, m in model.named_modules():
        st = layer_state.state_of(m)
        if st is not None or layer_state.observed(m) is not None:  # (a layer SGLang prepares: no state, None)
            out[name] = {"params": [n for n, _ in m.named_parameters(recurse=False)], "clean": st and st.clean}
    return out
