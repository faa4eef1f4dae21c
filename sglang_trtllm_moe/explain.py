"""`explain`: which MoE runner backend a model directory gets, and why, without a GPU.

The same rules as the resolution hook (selection/), offline from config.json, plus — when SGLang is installed —
SGLang's own resolution of the same model with and without the plugin (device="cpu", platform faked to the asked SM:
`compat.fake_platform`, the one place that fakes a platform).
"""

from __future__ import annotations


def _sglang_resolutions(model_path: str, sm: int | None, server_kwargs: dict) -> dict:
    """moe_runner_backend from SGLang's real resolution (device="cpu", platform faked to `sm`): upstream alone
    (our hook present but switched off through SGLANG_TRTLLM_MOE_AUTO=0) and with the plugin."""
    import contextlib
    import os

    from .compat.fake_platform import fake_platform
    from .compat.platform import resolved_moe_runner_backend
    from .doctor import load_into_this_process
    from .plugin import state
    from .selection import ENV_AUTO

    load_into_this_process()
    from sglang.srt.server_args import ServerArgs

    out: dict = {"plugin_status": state().status}
    saved = os.environ.get(ENV_AUTO)
    try:
        for key, auto in (("upstream_alone", "0"), ("with_plugin", saved if saved is not None else "1")):
            os.environ[ENV_AUTO] = auto
            scope = fake_platform(sm) if sm is not None else contextlib.nullcontext()
            try:
                with scope:
                    out[key] = resolved_moe_runner_backend(
                        ServerArgs(model_path=model_path, device="cpu", **server_kwargs)
                    )
            except Exception as e:  # noqa: BLE001 - SGLang rejecting the configuration is an answer too
                out[key] = None
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"
    finally:
        if saved is None:
            os.environ.pop(ENV_AUTO, None)
        else:
            os.environ[ENV_AUTO] = saved
    return out


def explain_model(
    model_path: str,
    *,
    sm: int | None = None,
    tp_size: int = 1,
    ep_size: int = 1,
    quantization: str | None = None,
    a2a_backend: str = "none",
    enable_eplb: bool = False,
    moe_runner_backend: str = "auto",
    run_sglang: bool = True,
    server_args: dict | None = None,
    return_routed_experts: bool = False,
    weight_cache_mode: str = "off",
    speculative_algorithm: str | None = None,
) -> dict:
    """The resolution report for a model directory (config.json only), without a GPU.

    `server_args`: further ServerArgs fields for SGLang's own resolution (e.g. `disable_radix_cache=True` for a
    hybrid Mamba model on a faked platform: SGLang's Mamba snapshot check asks for a real CUDA platform).
    `speculative_algorithm`: as --speculative-algorithm; the report then says which update entry points of the
    installed SGLang leave the draft stale (`draft_updates`). Raises ExplainInputError (one line per problem) for a
    directory without a readable config.json and for arguments SGLang would refuse (explain_checks)."""
    from .explain_checks import ExplainInputError, argument_problems, first_forward, read_config
    from .selection import DeviceInfo, flashinfer_version, problem_from_hf_config, resolve

    config = read_config(model_path)
    refused = argument_problems(
        moe_runner_backend=moe_runner_backend, a2a_backend=a2a_backend, quantization=quantization, sm=sm
    )
    if refused:
        raise ExplainInputError("\n".join(refused))
    problem = problem_from_hf_config(
        config,
        quantization=quantization,
        tp_size=tp_size,
        ep_size=tp_size if a2a_backend != "none" else ep_size,
        a2a_backend=a2a_backend,
        enable_eplb=enable_eplb,
        return_routed_experts=return_routed_experts,
        weight_cache_mode=weight_cache_mode,
    )
    if sm is not None:
        device = DeviceInfo(sm=sm, flashinfer_version=flashinfer_version(), source="cli --sm")
    else:
        device = _local_device()
    sglang: dict = {}
    if run_sglang:
        kwargs = dict(server_args or {})
        kwargs.update(
            tp_size=tp_size,
            ep_size=ep_size,
            moe_runner_backend=moe_runner_backend,
            moe_a2a_backend=a2a_backend,
            enable_eplb=enable_eplb,
        )
        if return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        if weight_cache_mode != "off":
            kwargs["weight_cache_mode"] = weight_cache_mode
        if quantization is not None:
            kwargs["quantization"] = quantization
        try:
            sglang = _sglang_resolutions(model_path, device.sm, kwargs)
        except Exception as e:  # noqa: BLE001 - no SGLang (or an older one): the plugin's rules still answer
            sglang = {"error": f"{type(e).__name__}: {e}"}
    if problem is None:
        return {
            "winner": sglang.get("with_plugin") or moe_runner_backend,
            "code": "NOT_MOE",
            "reason": "the model has no routed experts (no num_experts / n_routed_experts in config.json)",
            "candidates": [],
            "problem": None,
            "sglang": sglang,
        }
    res = resolve(problem, device, requested=moe_runner_backend, upstream=sglang.get("upstream_alone"))
    out = {
        **res.to_dict(),
        "problem": problem.to_dict(),
        "sglang": sglang,
        "plugin_prepares": _prepares(problem),
        "routed_experts": _routed_experts(res.winner, problem, device),
    }
    if run_sglang:
        out["capabilities"] = _capabilities(problem)
    out["first_forward"] = first_forward(res.winner, problem, device)
    if device.sm is None:
        out["note"] = NO_GPU_NOTE
    if speculative_algorithm is not None:
        out["draft_updates"] = _draft_updates(speculative_algorithm)
    return out


def _capabilities(problem) -> list[dict]:
    """The capability groups the plugin's path for this model needs, as this process decides them (`doctor` lists
    every group): active, or stepped aside with why — the model's layers then stay on SGLang's own path, or an
    explicit flashinfer_trtllm stops at model load (capabilities.py)."""
    try:
        from . import capabilities
        from .plugin import state

        if not state().enabled:
            return []
        fmt, _ = problem.weight_format()
        names = {*capabilities.PREP_NEEDS, "batched-writes", "auto-select", *([fmt.name] if fmt is not None else [])}
        return [row for row in capabilities.report(load=True) if row["capability"] in names]
    except Exception as e:  # noqa: BLE001 - the report answers without it
        return [{"capability": "?", "status": "undecided", "why": [f"{type(e).__name__}: {e}"]}]


def _draft_updates(algorithm: str) -> dict:
    """Whether every RL update entry point of the installed SGLang reaches the speculative draft."""
    from .compat.releases import installed_version
    from .updates import stale_draft

    if not stale_draft.has_draft_model(algorithm):
        return {"stale_after": [], "reason": f"--speculative-algorithm {algorithm} runs no draft model"}
    text = stale_draft.note(f"the speculative draft ({algorithm})") if installed_version() is not None else None
    if text is not None:
        return {"stale_after": ["update_weights_from_distributed"], "reason": text}
    if installed_version() is None:
        return {
            "stale_after": None,
            "reason": "SGLang is not installed here: which entry points reach the draft "
            "depends on its release (update_weights_from_distributed leaves it stale before 0.5.21)",
        }
    return {
        "stale_after": [],
        "reason": f"SGLang {installed_version()} loads disk and IPC updates into the target and the draft, tensor "
        "and distributed updates into the runners the request's `selector` names (default all)",
    }


#: what `explain` adds when it was asked about this machine and this machine has no CUDA GPU
NO_GPU_NOTE = (
    "this machine has no CUDA GPU, so the answer is for no GPU at all; to ask how the model resolves on a "
    "Blackwell server, pass --sm 100 (B200 / GB200) or the SM of your GPU"
)


def writer_contract(fmt_name: str | None) -> dict:
    """What a loader-free writer writes into every layer of format `fmt_name` inside a weight-update session, and
    what the plugin does at its end (updates/writer_contract.py; the exact byte placement per rank needs a loaded
    model: `sglang_trtllm_moe.writer_contract(model)`)."""
    from .formats import by_name
    from .updates.writer_contract import format_contract

    if fmt_name is None:
        return {"format": None, "params": [], "note": "the plugin lays out no layer of this model"}
    return {
        "format": fmt_name,
        "params": format_contract(by_name(fmt_name)),
        "note": "inside a begin/end weight-update session each parameter holds checkpoint layout: the bytes "
        "SGLang's own loader leaves there; where each shard goes per expert slot on a rank, and the shapes: "
        "sglang_trtllm_moe.writer_contract(model) on a loaded model",
    }


def _prepares(problem) -> dict:
    """Which format the plugin lays out for this checkpoint, and on which runner backends (in place, per expert)."""
    from .formats import prepared_on

    fmt, why = problem.weight_format()
    if fmt is None:
        return {"format": None, "backends": [], "reason": why}
    return {
        "format": fmt.name,
        "title": fmt.title,
        "backends": list(prepared_on(fmt)),
        "reason": f"{fmt.title}: prepared in place, per dirty expert, on {', '.join(prepared_on(fmt))}",
    }


def _routed_experts(winner: str, problem, device) -> dict:
    """What `--enable-return-routed-experts` (R3) returns for this model's MoE layers on the chosen runner."""
    from . import env
    from .formats import TRTLLM, TRTLLM_ROUTED
    from .kernel_api import RoutingMethodType, replays_routing

    method = RoutingMethodType(problem.routing_method).name if problem.routing_method is not None else None
    if winner == TRTLLM:
        if env.emulating() or replays_routing(device.flashinfer_version, problem.routing_method):
            source = "kernel"
            why = (
                f"{TRTLLM} routes in the kernel; the plugin passes it routing_replay_out and hands the experts it "
                "routed to SGLang's own capturer (exactly SGLang's top-k, as sets per token)"
            )
        else:
            source = "sglang_topk"
            why = (
                f"flashinfer {device.flashinfer_version}'s kernels do not report the experts they route for "
                f"{method or 'this routing method'}: the plugin routes these layers with SGLang's own top-k (which "
                f"captures them) and the routed kernel; explicitly on {TRTLLM} with R3 on, model load stops with a "
                "TrtllmLayerError"
            )
    elif winner == TRTLLM_ROUTED:
        source, why = "sglang_topk", f"{TRTLLM_ROUTED}: SGLang's own top-k routes and captures; the kernel computes"
    else:
        source, why = "sglang", f"{winner}: SGLang's own path captures what it routes (the plugin is not involved)"
    return {"source": source, "routing_method": method, "reason": why}


def _local_device():
    from .selection import DeviceInfo, flashinfer_version

    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return DeviceInfo(sm=major * 10 + minor, flashinfer_version=flashinfer_version(), source="torch.cuda")
    except Exception:  # noqa: BLE001
        pass
    return DeviceInfo(sm=None, flashinfer_version=flashinfer_version(), source="no CUDA device")
