"""A whole model booted from a running one (`--load-format remote_instance`), in one process (issue #53).

    python -m tests.support.remote_instance_worker ARCH QUANT    # prints {check: {"ok": bool, ...}}

The seed is `sandbox.models.TinyModel` (SGLang's ModelRunner, a tiny checkpoint, the plugin preparing every MoE
layer). The new instance is SGLang's own `get_model()` with the seed's load config turned into
`--load-format remote_instance`: `RemoteInstanceModelLoader.load_model` builds the model and copies it —
transfer_engine: the whole real path, with the in-process stand-ins of tests/support/remote_instance.py for the
RDMA read, the seed's published info and its memory registration (register_memory_region_v1); nccl: the model
SGLang's loader builds (`_initialize_model`), then its `load_model_from_remote_instance_by_nccl` with a forked copy
of the seed sending through its own WeightExporter over gloo. Checks, per backend: every parameter and buffer of
the new model equals the seed's, byte for byte (SGLang's parameters; the plugin's kernel scalars are computed);
greedy tokens and prefill logits through the seed's runner equal the seed's; an RL update (tensors of two experts of
every MoE layer, in a session) lands on both alike; a loader-free session on the new instance equals the same on
the seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SGLANG_TRTLLM_MOE_TEST_THREADS", "1"))

import torch

PROMPTS = [[5, 17, 42, 99, 260, 311, 7], [100, 200, 300, 400]]


def _remote_config(seed, backend, engine=None):
    from sglang.srt.model_loader.remote_instance_weight_loader_utils import RemoteInstanceWeightLoaderBackend

    return dataclasses.replace(
        seed.runner.load_config,
        load_format="remote_instance",
        remote_instance_weight_loader_backend=RemoteInstanceWeightLoaderBackend(backend),
        remote_instance_weight_loader_transfer_engine=engine,
        remote_instance_weight_loader_seed_instance_ip="127.0.0.1",
        remote_instance_weight_loader_seed_instance_service_port=0,
        remote_instance_weight_loader_send_weights_group_ports=[0],
    )


def boot_transfer_engine(seed):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.model_loader import get_model, loader
    from sglang.srt.model_loader.remote_instance_weight_loader_utils import register_memory_region_v1

    from . import remote_instance as R

    engine = R.InProcessTransferEngine()
    published = (engine.session_id, R.seed_weight_info(seed.model, engine))
    loader.get_remote_instance_transfer_engine_info_per_rank = lambda url, rank: published
    # v2 asks torch.cuda for its allocator's segments; v1 registers the same parameters one by one
    loader.register_memory_region = register_memory_region_v1
    return get_model(
        model_config=seed.model_config,
        load_config=_remote_config(seed, "transfer_engine", engine),
        device_config=DeviceConfig("cpu", 0),
    )


def boot_nccl(seed):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.loader import RemoteInstanceModelLoader, _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from . import remote_instance as R

    load_config = _remote_config(seed, "nccl")
    with set_default_torch_dtype(seed.model_config.dtype), torch.device("cpu"):
        model = _initialize_model(
            seed.model_config, load_config, _get_quantization_config(seed.model_config, load_config)
        )
    sender = R.Seed(seed.model)
    try:
        loader.trigger_transferring_weights_request = sender.trigger
        with R.bytes_over_gloo():
            RemoteInstanceModelLoader(load_config).load_model_from_remote_instance_by_nccl(
                model, sender, seed.model_config, DeviceConfig("cpu", 0)
            )
        answer = sender.answer()
    finally:
        sender.close()
    assert answer is not None and answer[0], answer
    return model.eval()


def _experts_update(seed_dir_2):
    """Two experts of every MoE layer of checkpoint 2, as a trainer sends them."""
    import glob

    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(glob.glob(os.path.join(seed_dir_2, "*.safetensors"))):
        tensors.update(load_file(f))
    return [(n, t) for n, t in sorted(tensors.items()) if ".experts.1." in n or ".experts.2." in n]


def _update(model, model_config, named):
    from .sglang_runtime import weight_updater

    u = weight_updater(model, model_config)
    u.begin_weight_update()
    ok, msg = u.update_weights_from_tensor(named)
    u.end_weight_update(run_post_load=False)
    assert ok, msg


def run(arch: str, quant: str) -> dict:
    from sglang_trtllm_moe.sandbox import checkpoints as ck
    from sglang_trtllm_moe.sandbox import models

    torch.cuda.synchronize = lambda *a, **k: None  # releases that sync around the copy: nothing to wait for here
    work = tempfile.mkdtemp(prefix="trtllm-moe-remote-")
    spec = ck.TinySpec(arch, quant, seed=0)
    d0 = ck.write(os.path.join(work, "s0"), spec)
    d2 = ck.write(os.path.join(work, "s2"), spec.with_seed(2))
    seed = models.TinyModel(d0)
    out = {}
    named = _experts_update(d2)
    for backend, boot in (("transfer_engine", boot_transfer_engine), ("nccl", boot_nccl)):
        try:
            want_tokens, want_logits = seed.generate(PROMPTS)  # what the seed serves now (updated by the last round)
            new = boot(seed)
            differs = seed.differences(new)
            tokens, logits = seed.generate(PROMPTS, model=new)
            same = tokens == want_tokens and torch.equal(logits, want_logits)
            _update(new, seed.model_config, named)
            _update(seed.model, seed.model_config, named)
            after = seed.differences(new)
            out[backend] = {
                "ok": not differs and same and not after,
                "differs": differs[:8],
                "tokens_equal": tokens == want_tokens,
                "logits_equal": bool(torch.equal(logits, want_logits)),
                "after_update_differs": after[:8],
            }
        except Exception as e:  # noqa: BLE001 - reported, the other backend still runs
            out[backend] = {"ok": False, "detail": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    out["control"] = _control(seed)
    return out


def _control(seed) -> dict:
    """The same transfer_engine boot with the plugin's adoption switched off: the new instance must not serve what
    the seed serves (the checks above can fail)."""
    from sglang_trtllm_moe.builtins import remote_instance

    real = remote_instance.adopt
    remote_instance.adopt = lambda model, mode=None: 0
    try:
        want = seed.generate(PROMPTS)
        new = boot_transfer_engine(seed)
        got = seed.generate(PROMPTS, model=new)
        same = got[0] == want[0] and torch.equal(got[1], want[1])
        return {"ok": not same, "detail": "served the seed's tokens without adoption" if same else "differs"}
    except Exception as e:  # noqa: BLE001 - an unprepared layer may fail outright: the control holds
        return {"ok": True, "detail": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        remote_instance.adopt = real


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from sglang_trtllm_moe.sandbox import models

    models.prepare_process()
    print(json.dumps(run(argv[0], argv[1])))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
