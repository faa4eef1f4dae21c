"""sglang.Engine on a CPU box, driven through its public API the way an RL framework drives a rollout engine.

`TinyEngine(model_dir)` is `sglang.Engine(model_path=..., device="cpu", ...)` with the harness's flags
(models.DEFAULT_SERVER_ARGS: torch_native attention, `--moe-runner-backend auto` on a faked SM100, ...). The Engine
spawns its scheduler and detokenizer processes itself; they get the CPU stand-ins, the faked SM100 and the emulated
kernels from the plugin itself — SGLang's load_plugins() runs its register() first in every process it starts, and
with the test-only switches SGLANG_TRTLLM_MOE_EMULATE=1 and SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100 (inherited) it
activates the CPU sandbox (activation.py) — and single-threaded torch through OMP_NUM_THREADS. What it
offers is only what the Engine offers:

| method | Engine API |
|---|---|
| generate | `Engine.generate(input_ids=..., sampling_params={"temperature": 0, ...})` (greedy) |
| update_from_disk | `Engine.update_weights_from_disk(path)` |
| begin / end / session | `Engine.begin_weight_update()` / `end_weight_update()` (0.5.21+; 0.5.23 refuses tensor
  updates outside) |
| update_from_tensor | `Engine.update_weights_from_tensor(named_tensors)` (in a session where the release has them);
  `load_format="flattened_bucket"`: one SGLang FlattenedTensorBucket serialized per TP rank with
  MultiprocessingSerializer (base64), as RL frameworks send it |
| wait_idle | `Engine.flush_cache()` until it succeeds: the scheduler has retired the last batch (every update waits
  for it: an update that reaches the scheduler first fails SGLang's "Cache flush failed after updating weights"
  assertion, which ends the scheduler; seen on 0.5.20) |
| check_weights | the weight checker (`/weights_checker` of the HTTP server): `tokenizer_manager.check_weights(
  CheckWeightsReqInput(action=...))` — snapshot, reset_tensors, compare, checksum (the Engine has no method of its
  own) |
| state | `Engine.save_sharded_model(path=...)`: the scheduler writes model.state_dict() (the prepared bytes) as
  safetensors; read back here, byte for byte |

Release support: releases.py ENGINE_RELEASES (every release: start-up, generate, updates, read-back;
tests/test_engine_smoke.py on each), with the server arguments of each release (`engine_args()`: BF16_GEMM_TORCH).
The RL loop the demo runs on it (sessions, the weight checker, a fresh ModelRunner load as the reference):
sandbox/rl_loop.py, RL_LOOP_RELEASES.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import tempfile

import torch

from ..compat.features import UPDATE_SESSIONS
from . import models
from .releases import (
    BF16_GEMM_TORCH,
    DETOKENIZER_IMPORTS_XGRAMMAR,
    ENGINE_RELEASES,
    SAVE_SHARDED_MODEL_TAKES_PARAMS,
)

#: the faked SM the Engine's processes run with
FAKE_SM = 100


class EngineUnavailable(RuntimeError):
    pass


def prepare_process(workdir: str | None = None) -> None:
    """This process as the Engine's launcher needs it; its children get the same through the plugin's own
    register() (the test-only switches, set here in the environment they inherit). `workdir` is unused (kept for
    callers of the spawn-path era)."""
    from ..runner import ENV_EMULATE
    from .activation import ENV_FAKE_SM
    from .runtime import release

    if release() not in ENGINE_RELEASES:
        raise EngineUnavailable(
            f"sandbox.engine drives sglang.Engine of SGLang {ENGINE_RELEASES}; this is SGLang {release()}"
        )
    if DETOKENIZER_IMPORTS_XGRAMMAR.present() and importlib.util.find_spec("xgrammar") is None:
        # sglang requires it (Requires-Dist: xgrammar); the CPU env installs sglang --no-deps
        raise EngineUnavailable(
            "sglang.Engine's detokenizer imports xgrammar (function_call/function_call_parser.py -> "
            "inkling_detector.py `from xgrammar import StructuralTag`), and this environment has none: install the "
            "release's pin (ci/releases.tsv extra-no-deps)"
        )
    os.environ[ENV_EMULATE] = "1"
    os.environ[ENV_FAKE_SM] = str(FAKE_SM)
    models.prepare_process(runner=False)


def engine_args(**overrides) -> dict:
    """The harness's Engine arguments (models.DEFAULT_SERVER_ARGS with `overrides`) as this release spells them: the
    BF16 GEMM backend is named only where 'torch' exists (BF16_GEMM_TORCH); before, SGLang's default never reaches
    the cutedsl GEMM."""
    kw = {**models.DEFAULT_SERVER_ARGS, **overrides}
    if not BF16_GEMM_TORCH.present():
        kw.pop("bf16_gemm_backend", None)
    return kw


@contextlib.contextmanager
def _children_output(path: str | None):
    """While the Engine spawns its processes, this process's stdout / stderr (file descriptors 1 and 2, which the
    children inherit) point to `path`; restored afterwards, so only the children keep writing there."""
    if path is None:
        yield
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class TinyEngine:
    """sglang.Engine(device="cpu") for a tiny checkpoint, through the Engine's public API only."""

    def __init__(self, model_dir: str, workdir: str | None = None, log: str | None = None, **server_args):
        """`log`: a file for the output of the processes the Engine spawns (scheduler, detokenizer: SGLang's own
        log lines and tracebacks, e.g. the one its weight checker prints for a failed compare); default: inherited."""
        import sglang

        self.workdir = workdir or tempfile.mkdtemp(prefix="sglang-trtllm-moe-engine-")
        prepare_process(self.workdir)
        kw = engine_args(**server_args)
        self.model_dir = model_dir
        self.log = log
        with _children_output(log):
            self.engine = sglang.Engine(model_path=model_dir, skip_tokenizer_init=True, **kw)
        self._session = False
        self._n = 0

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- forward ---------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 4) -> list[list[int]]:
        out = self.engine.generate(
            input_ids=[list(p) for p in prompts], sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}
        )
        return [list(o["output_ids"]) for o in out]

    def generate_routed(self, prompts: list[list[int]], max_new_tokens: int = 4) -> tuple[list, list]:
        """`generate` with `return_routed_experts` (an Engine started with models.ROUTED_EXPERTS_ARGS): (tokens per
        prompt, routed experts per prompt as [prompt_len + max_new_tokens - 1][num_hidden_layers][top_k], decoded
        from meta_info["routed_experts"] by SGLang's own helper)."""
        from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

        out = self.engine.generate(
            input_ids=[list(p) for p in prompts],
            sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens},
            return_routed_experts=True,
        )
        tokens = [list(o["output_ids"]) for o in out]
        routed = []
        for o, p in zip(out, prompts, strict=True):
            flat = extract_routed_experts_from_meta_info(o).tolist()
            n = len(p) + max_new_tokens - 1
            per_token = len(flat) // n
            rows = [flat[t * per_token : (t + 1) * per_token] for t in range(n)]
            k = self.engine.tokenizer_manager.model_config.hf_text_config.num_experts_per_tok
            routed.append([[r[i : i + k] for i in range(0, per_token, k)] for r in rows])
        return tokens, routed

    # ---- RL entry points -------------------------------------------------------------------------------------------

    @staticmethod
    def _ok(result, what: str) -> str:
        ok, msg = result[0], result[1]
        if not ok:
            raise RuntimeError(f"{what} failed: {msg}")
        return msg

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the scheduler has retired its last batch: SGLang answers a generate request before its loop drops
        that batch, and an update that arrives in between fails the flush after it (an assertion in the scheduler,
        which then exits). An RL loop's rollout ends long before its update; this harness's next line does not."""
        import time

        deadline = time.monotonic() + timeout
        while not _flushed(self.engine.flush_cache()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Engine's scheduler did not go idle within {timeout} s")
            time.sleep(0.05)

    def update_from_disk(self, path: str) -> str:
        self.wait_idle()
        return self._ok(self.engine.update_weights_from_disk(path), "update_weights_from_disk")

    def begin(self) -> None:
        self.wait_idle()
        self._ok(self.engine.begin_weight_update(), "begin_weight_update")
        self._session = True

    def end(self) -> None:
        self._session = False
        self._ok(self.engine.end_weight_update(), "end_weight_update")

    @contextlib.contextmanager
    def session(self):
        self.begin()
        try:
            yield self
        finally:
            self.end()

    def update_from_tensor(self, named_tensors, load_format: str | None = None, check: bool = True):
        """One Engine.update_weights_from_tensor call (inside a session; one is opened here if none is).
        Returns (success, message); raises on failure when `check`."""
        own = not self._session and UPDATE_SESSIONS.present()
        if own:
            self.begin()  # waits for the scheduler to go idle
        elif not self._session:
            self.wait_idle()
        try:
            if load_format == "flattened_bucket":
                from sglang.srt.utils.common import MultiprocessingSerializer

                payload = [MultiprocessingSerializer.serialize(models.flattened_bucket(named_tensors), output_str=True)]
            else:
                payload = list(named_tensors)
            res = self.engine.update_weights_from_tensor(payload, load_format=load_format)
        finally:
            if own:
                self.end()
        if check:
            self._ok(res, "update_weights_from_tensor")
        return res[0], res[1]

    # ---- weight checker and readback -------------------------------------------------------------------------------

    def check_weights(self, action: str, **kwargs) -> tuple[bool, str]:
        """SGLang's weight checker through the tokenizer manager (what POST /weights_checker does)."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        req = CheckWeightsReqInput(action=action, **kwargs)
        res = self.engine.loop.run_until_complete(self.engine.tokenizer_manager.check_weights(req, None))
        return bool(res[0]), str(res[1])

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the served model's state_dict as the scheduler holds it (Engine.save_sharded_model)."""
        from safetensors.torch import load_file

        self._n += 1
        path = os.path.join(self.workdir, f"state-{self._n}")
        os.makedirs(path, exist_ok=True)
        args = dict(path=path, pattern=None, max_size=None)
        if SAVE_SHARDED_MODEL_TAKES_PARAMS.present():
            self.engine.save_sharded_model(params=args)
        else:
            self.engine.save_sharded_model(**args)
        out: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            out.update(load_file(f))
        for f in glob.glob(os.path.join(path, "*.safetensors")):
            os.remove(f)
        return out


def _flushed(result) -> bool:
    """Engine.flush_cache()'s answer: a FlushCacheReqOutput (its `success`) or, on some releases, a bool."""
    return bool(getattr(result, "success", result))


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes (or dtype / shape) differ between two states; names present in one only."""
    if set(a) != set(b):
        return sorted(set(a) ^ set(b))
    return [
        n
        for n in a
        if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(as_bytes(a[n]), as_bytes(b[n]))
    ]
