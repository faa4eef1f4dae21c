"""New instances that boot from a running one's memory (`--load-format remote_instance`), exact or refused.

SGLang's `RemoteInstanceModelLoader` builds the model (SGLang's parameters, as create_weights allocates them), copies
every parameter's raw bytes from the seed — the nccl backend: the seed broadcasts its `named_parameters()` in order
(`send_weights_to_remote_instance`), the new instance receives into its own, in its order; the transfer_engine
backend: the new instance RDMA-reads each of its own parameters from the seed's by name (numel and element size
checked) — and then runs only `post_load_weights`: `process_weights_after_loading`, where the plugin takes a layer
over, never runs there (features.REMOTE_INSTANCE_LOADER). Under the plugin the seed's MoE layers hold the kernel
layout, and their kernel scalars are Parameters the plugin registered after SGLang's. So:

* **the new instance adopts** (both backends): once the bytes are in, every FusedMoE layer goes through its quant
  method's `process_weights_after_loading` with the plugin in adopt mode (builtins/_prepare.py `adopting`): the same
  decision as on the seed (format, kernel limits, compat/defer.py), and a layer the plugin serves is taken over as
  already laid out (`layer_state.adopt`: no second layout — never packed twice —, its kernel scalars computed from
  the copied scale parameters, exactly the seed's); a layer SGLang serves itself is left as upstream leaves it
  (SGLang's preparation is not run, as upstream does not run it). Its later RL updates go through the plugin as on
  any instance;
* **the seed hands out SGLang's parameters only** (nccl): while it sends, the parameters the plugin registered on
  its layers (the kernel scalars) are out of `named_parameters()`, so the broadcast sequence is the new instance's;
  its layers are laid out first if anything is pending, and it refuses (False, message) to send while a weight-update
  session is open on it (its layers are then in checkpoint layout, being written);
* **modelexpress**: its loader copies a peer's bytes or falls back to SGLang's DefaultModelLoader, and nothing says
  which: a layer the plugin would serve that no `process_weights_after_loading` reached (a peer's bytes of unknown
  layout) stops start-up with the reason and the fix; where the fallback loaded the checkpoint the plugin prepared it
  as on any load.

A transfer_engine seed's bytes are read without the seed taking part: an instance must not boot from a seed while
a weight-update session is open there (docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

from .. import hookimpl, layer_state
from ..compat import features
from ..targets import HookTarget
from . import _prepare

logger = logging.getLogger("sglang_trtllm_moe")

LOADER = "sglang.srt.model_loader.loader.RemoteInstanceModelLoader"
EXPORTER = "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"

#: why a modelexpress-loaded layer is refused, and the fix
MODELEXPRESS_REFUSAL = (
    "--load-format remote_instance with --remote-instance-weight-loader-backend modelexpress copied this layer's "
    "bytes from a peer without process_weights_after_loading, and nothing says whether the peer laid them out "
    "for the TRT-LLM kernel (sglang-trtllm-moe or SGLang's own layout) or holds checkpoint layout: serving it could "
    "pack it twice or not at all. Fix: --remote-instance-weight-loader-backend nccl or transfer_engine from a seed "
    "that runs sglang-trtllm-moe, or load the checkpoint (--load-format auto)"
)


PWAL = "process_weights_after_loading"


def _hooked_classes() -> list:
    """The classes whose process_weights_after_loading the plugin hooks on this release (their hook is the
    function a subclass that does not override it resolves to)."""
    import pkgutil

    from ..plugin import state

    out = []
    for t in state().targets:
        if t.target.endswith("." + PWAL):
            try:
                out.append(pkgutil.resolve_name(t.target[: -len(PWAL) - 1]))
            except (ImportError, AttributeError, ValueError):
                continue
    return out


def _through_the_plugin(layer, classes: list) -> bool:
    """Whether `layer`'s post-load step reaches one of the plugin's hooks (its quant method's own, or the
    compressed-tensors scheme it delegates to): only then is it run on a remote instance — a quant method the
    plugin does not hook keeps upstream's remote loading, where nothing runs."""
    for obj in (layer.quant_method, getattr(layer, "scheme", None)):
        if obj is None:
            continue
        fn = inspect.getattr_static(type(obj), PWAL, None)
        if fn is not None and any(inspect.getattr_static(c, PWAL, None) is fn for c in classes):
            return True
    return False


def adopt(model, mode: str = _prepare.ADOPT) -> int:
    """Every FusedMoE layer of `model` whose post-load step the plugin hooks, through it in adopt mode (the module
    docstring). Returns the layers the plugin manages afterwards."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    classes = _hooked_classes()
    _prepare.set_adopting(mode)
    try:
        for module in model.modules():
            if isinstance(module, FusedMoE) and getattr(module, "quant_method", None) is not None:
                if _through_the_plugin(module, classes):
                    module.quant_method.process_weights_after_loading(module)
    finally:
        _prepare.set_adopting(None)
    return sum(layer_state.state_of(m) is not None for m in model.modules())


def adopt_after_nccl(result, loader, model, *args, **kwargs):
    """load_model_from_remote_instance_by_nccl(model, ...): the seed's bytes are in."""
    n = adopt(model)
    logger.info("sglang-trtllm-moe: remote instance (nccl): %d MoE layer(s) adopted as the seed laid them out", n)
    return None


def adopt_after_transfer_engine(result, loader, model, *args, **kwargs):
    """load_model_from_remote_instance_by_transfer_engine(model, ...) -> True: the seed's bytes are in."""
    if result:
        n = adopt(model)
        logger.info(
            "sglang-trtllm-moe: remote instance (transfer_engine): %d MoE layer(s) adopted as the seed laid them out",
            n,
        )
    return None


def check_modelexpress_after(model, loader, *args, **kwargs):
    """RemoteInstanceModelLoader.load_model on the modelexpress backend: a layer the plugin would serve that was not
    prepared on this instance is refused at start-up (MODELEXPRESS_REFUSAL)."""
    backend = getattr(getattr(loader, "load_config", None), "remote_instance_weight_loader_backend", None)
    if model is not None and str(getattr(backend, "value", backend)).lower() == "modelexpress":
        adopt(model, MODELEXPRESS_REFUSAL)
    return None


@contextlib.contextmanager
def only_sglangs_parameters(model):
    """For the block: each managed layer of `model` shows SGLang's parameters only (those it had when the plugin
    took it over: what a new instance built from the same config holds), in their order; the plugin's are put back
    after, the same objects. The caller is the scheduler thread (no forward meanwhile)."""
    saved = []
    for module in model.modules():
        names = layer_state.loaded_params(module)
        if not names:
            continue
        params = module._parameters
        keep = set(names)
        if any(n not in keep for n in params):
            saved.append((module, dict(params)))
            for n in [n for n in params if n not in keep]:
                del params[n]
    try:
        yield
    finally:
        for module, before in saved:
            module._parameters.clear()
            module._parameters.update(before)


#: the answer of a seed asked to send while a session is open
SESSION_OPEN = (
    "sglang-trtllm-moe: refused to send weights to a remote instance: a weight-update session is open on this seed "
    "(begin_weight_update without end_weight_update), so its MoE layers hold checkpoint layout being written; end "
    "the session, then boot the new instance"
)


def send_around(original, owner, *args, **kwargs):
    """The seed's send_weights_to_remote_instance (nccl): SGLang's parameters only, laid out, never mid-session."""
    get = getattr(owner, "get_model", None)
    model = get() if callable(get) else getattr(owner, "model", None)
    if model is None or not any(layer_state.loaded_params(m) for m in model.modules()):
        return original(owner, *args, **kwargs)
    if layer_state.SESSION["open"]:
        logger.error(SESSION_OPEN)
        return False, SESSION_OPEN
    layer_state.flush_all(model=model)
    with contextlib.ExitStack() as stack:
        for m in model.modules():
            stack.enter_context(layer_state.locked(m))
        stack.enter_context(only_sglangs_parameters(model))
        return original(owner, *args, **kwargs)


@hookimpl
def register_sglang_hooks(register, release):
    for path, hook, why in (
        (f"{LOADER}.load_model_from_remote_instance_by_nccl", adopt_after_nccl, "nccl"),
        (f"{LOADER}.load_model_from_remote_instance_by_transfer_engine", adopt_after_transfer_engine, "RDMA"),
    ):
        register(
            HookTarget(
                path,
                hook,
                "after",
                releases=features.REMOTE_INSTANCE_LOADER.releases,
                capability="remote-instance",
                why=f"a new instance booted from a seed's memory ({why}): its MoE layers adopted as the seed laid them "
                "out (never laid out twice), kernel scalars computed",
            )
        )
    register(
        HookTarget(
            f"{LOADER}.load_model",
            check_modelexpress_after,
            "after",
            releases=features.REMOTE_INSTANCE_LOADER.releases,
            capability="remote-instance",
            why="modelexpress: a layer of unknown layout (a peer's bytes) is refused at start-up, with the fix",
        )
    )
    for path, releases in (
        (f"{EXPORTER}.send_weights_to_remote_instance", features.WEIGHT_EXPORTER.releases),
        (f"{MODEL_RUNNER}.send_weights_to_remote_instance", features.WEIGHT_EXPORTER.before),
    ):
        register(
            HookTarget(
                path,
                send_around,
                "around",
                releases=releases,
                capability="remote-instance",
                why="a seed sends SGLang's parameters only (the plugin's kernel scalars out of the broadcast), laid "
                "out, and never while a weight-update session is open",
            )
        )
