"""Flush points: the end of every weight-update entry point of the running release.

`update_weights_from_disk` re-runs process_weights_after_loading, which our quant-method hook turns into a flush
of the dirty experts. The tensor / distributed / IPC paths only call `model.load_weights`: without a flush their
experts would stay in checkpoint layout (upstream: silent garbage, vllm#42821), so they get an AFTER hook.
Every entry point also drops the cached index maps first (sglang#28676).

Whole buckets: the tensor / distributed / IPC entry points hand a list of tensors to `model.load_weights`, which
loads them in order; a bad 5th tensor would leave the first four written. While such an entry point runs, the
model's `load_weights` first validates every tensor of the list that targets a managed layer (bucket_validation.py
`check_bucket`): one bad tensor refuses the whole bucket before any of it is written, and the entry point returns
(False, message) as SGLang's update entry points report failures. A disk update is checked the same way from the
checkpoint's files (headers, sizes, every scale's values: checkpoint_headers.py) before SGLang returns any layer to
checkpoint layout, and is whole or nothing: if SGLang's load still fails, the served weights are put back
(rollback.py) and the update answers (False, message) instead of raising out of the scheduler.
With a speculative draft, SGLang's scheduler loads one disk / tensor / IPC request (from 0.5.21 distributed too) into
the target and the draft one after another: while it does, each runner's check covers the layers of every runner
still to load (builtins/runner_requests.py; what was checked for which: updates/request.py), so a bad draft
tensor refuses the request before the target loads any of it, on every release.
Whole-parameter writes (load_format="direct") are validated the same way and return the written groups to checkpoint
layout first, so they are exact outside a begin/end session too.
"""

from __future__ import annotations

import contextlib
import logging

from .. import aside, hookimpl, layer_state
from ..compat import features
from ..errors import WeightUpdateRefused
from ..targets import HookTarget
from ..updates import bucket_validation, checkpoint_headers, request, rollback, undo

logger = logging.getLogger("sglang_trtllm_moe")

UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
MANAGER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
MIXIN = "sglang.srt.managers.scheduler_update_weights_mixin.SchedulerUpdateWeightsMixin"


def drop_caches_before(*args, **kwargs):
    layer_state.on_reload_start()


def flush_after(result, *args, **kwargs):
    layer_state.flush_all()
    return None


def model_of(owner):
    get = getattr(owner, "get_model", None)
    return get() if callable(get) else getattr(owner, "model", None)


def _own_load_weights(model):
    """The model's own `load_weights`, where an entry point may stand a wrapper over it (`_load_weights_as`); None
    where it has none, or where an instance attribute already stands over the class's method (another entry point's
    wrapper, or someone else's)."""
    real = getattr(model, "load_weights", None)
    return None if real is None or "load_weights" in vars(model) else real


@contextlib.contextmanager
def _load_weights_as(model, wrapper):
    """For the block, `model.load_weights` is `wrapper` (an instance attribute over the class's method, which
    `wrapper` calls); removed after, an exception included. The one place an entry point wraps the model's loader."""
    vars(model)["load_weights"] = wrapper
    try:
        yield
    finally:
        vars(model).pop("load_weights", None)


#: what a refusal by the loader hook (not the request's check) leaves
PARTLY_WRITTEN = (
    "sglang-trtllm-moe: refused while SGLang loaded the request, not before: tensors ahead of it in the request may "
    "be written (every layer the plugin manages is laid out again); send the whole update again"
)


def check_buckets_around(original, owner, *args, **kwargs):
    """Validate each list `model.load_weights` gets during the entry point before it loads any of it (against the
    layers of every runner the same scheduler request loads after it, one verdict of all ranks), then write it:
    the request object (updates/request.py) does both; here are SGLang's arguments and answers. Whatever raises
    inside is answered (False, message), never raised into the scheduler; a custom loader's request is put back
    first (updates/undo.py)."""
    model = model_of(owner)
    stepped = aside.at_update(model)  # a layer the plugin stepped aside for, which SGLang cannot keep exact
    if stepped:
        return False, stepped
    real = _own_load_weights(model)
    with request.for_model(model) as req:
        if real is None or not req.concerns(model):
            # no loader to wrap (a model updated only by direct writes), or nothing of the plugin's in it: SGLang's own
            return original(owner, *args, **kwargs)
        refused: list = []
        named = args[0] if args else kwargs.get("named_tensors")
        load_format = args[1] if len(args) > 1 else kwargs.get("load_format")
        # a loader of the user's (--custom-weight-loader): nothing checked up front (its lists to load_weights are),
        # what it writes copied first (undo.py), written by SGLang's loader: one `copy_` per destination, as it may
        # expect
        custom = isinstance(load_format, str) and load_format not in ("direct", "flattened_bucket")
        if isinstance(named, (list, tuple)) and load_format is None:  # "direct": checked by check_direct_before
            # checked before SGLang touches the tensors (the same objects reaching load_weights are not checked twice,
            # nor again in the loader hooks: the request's record), and another rank's expert tensors never reach
            # SGLang here (it would unwrap each, then drop it)
            try:
                mine = req.entry(model, named)
            except bucket_validation.BucketRefused as e:
                return False, str(e)
            if mine is not named:
                args, kwargs = _with_named(mine, args, kwargs)

        def load_weights(weights, *a, **k):
            if guard is not None:  # a custom loader's first chunk: the parameters outside the MoE layers copied
                guard.save_rest()
            return req.load(model, real, weights, refused, *a, batched=not custom, **k)

        rollback.forget(model)  # served weights from tensors: no longer reproducible from disk loads
        with undo.guarded(model, bucket_validation.managed_modules(model).values(), on=custom) as guard:
            try:
                with _load_weights_as(model, load_weights):
                    result = original(owner, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - answered, never raised: SGLang's tensor entry point does not catch
                return False, _failed(e, guard)
            if guard is not None and (refused or not result[0]):  # SGLang caught it: the copies put back
                return False, f"{refused[0] if refused else result[1]}\n{guard.restore()}"
    if refused:  # SGLang caught it (and says "partially updated"): nothing of the bucket was written
        return False, str(refused[0])
    return result


def _failed(e: Exception, guard) -> str:
    """The answer to an entry point that raised; `guard`: the MoE layers the request wrote are put back first."""
    if isinstance(e, bucket_validation.BucketRefused):  # the request's check: nothing of that bucket written
        what, partly = str(e), ""
    elif isinstance(e, WeightUpdateRefused):  # a write the request's check could not place, refused by the loader hook
        logger.warning("sglang-trtllm-moe: a write refused while SGLang loaded the request: %s", e)
        what, partly = str(e), PARTLY_WRITTEN
    else:  # anything else: a custom loader's own error (verl's checksum), SGLang's loader, a bug
        logger.exception("sglang-trtllm-moe: a weight update raised")
        what, partly = f"Failed to update weights: {type(e).__name__}: {e}", PARTLY_WRITTEN.replace("refused", "failed")
    return f"{what}\n{guard.restore() if guard is not None else partly}".rstrip()


def _with_named(named, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The entry point's arguments with `named` as its named tensors."""
    if args:
        return (named, *args[1:]), kwargs
    return args, {**kwargs, "named_tensors": named}


def check_disk_around(original, owner, model_path, load_format=None, weight_name_filter=None, *args, **kwargs):
    """A disk update, whole or not at all. Before SGLang restores or loads anything (its rollback would re-read the
    same path): the checkpoint is refused if any file is cut short or any tensor of a managed layer is malformed —
    names, dtypes and shapes from the headers, every scale's values from the files (the request's
    `check_checkpoint`, one verdict of all ranks). Then a way back is prepared (rollback.py); if SGLang's load still
    fails, or raises, the served weights are put back and the update answers (False, message)."""
    model = model_of(owner)
    stepped = aside.at_update(model)
    if stepped:
        return False, stepped
    with request.for_model(model) as req:
        if model is None or not req.concerns(model):
            return original(owner, model_path, load_format, weight_name_filter, *args, **kwargs)
        names = None
        files = checkpoint_headers.files_of(model_path, load_format)
        checked = rollback.fingerprint(model_path) if files else None  # the files as the pre-check reads them
        # while SGLang loads them, the loader hooks check the structure of each write the pre-check validated, not
        # its values again (if a file changes meanwhile, the fingerprint below puts the served weights back)
        try:
            headers = req.check_checkpoint(model, files, (model_path, load_format, weight_name_filter), checked)
        except bucket_validation.BucketRefused as e:
            return False, str(e)
        if headers is not None:
            names = frozenset(n for n, _ in headers.tensors)
        net = rollback.prepare(model, names)
        try:
            with _batched_from_files(req, model, names is not None):
                result = original(owner, model_path, load_format, weight_name_filter, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - SGLang's load or its rollback raised: the scheduler must live
            logger.exception("sglang-trtllm-moe: update_weights_from_disk(%r) raised", model_path)
            req.release(model)
            return _put_back(net, original, owner, f"Failed to update weights: {type(e).__name__}: {e}", ())
    ok, message = result[0], str(result[1])
    if ok and checked is not None and rollback.fingerprint(model_path) != checked:
        # a file removed, added or rewritten while SGLang loaded: what it loaded is not what was checked (SGLang
        # itself loads whatever files are left and calls it a success)
        return _put_back(
            net,
            original,
            owner,
            f"Failed to update weights: the checkpoint {model_path} changed while it was loaded (a file removed, "
            "added or rewritten after the plugin checked it); write the checkpoint completely before updating",
            tuple(result[2:]),
        )
    if ok:
        if names is None:
            rollback.forget(model)
        else:
            rollback.succeeded(model, model_path, load_format, weight_name_filter, names)
        return result
    if rollback.SGLANG_ROLLED_BACK in message:  # SGLang had started writing, then re-read the path it failed on
        return _put_back(net, original, owner, message, tuple(result[2:]))
    return result


@contextlib.contextmanager
def _batched_from_files(req, model, checked: bool):
    """While a disk update whose checkpoint passed the pre-check loads: the model's `load_weights` writes the expert
    tensors the pre-check validated batched (the request's `load_from_files`); everything else goes through the
    model's own loader, in order."""
    real = _own_load_weights(model)
    if not checked or real is None:
        yield
        return

    def load_weights(weights, *a, **k):
        return req.load_from_files(model, real, weights, *a, **k)

    with _load_weights_as(model, load_weights):
        yield


def _put_back(net, original, owner, message: str, rest: tuple):
    try:
        how = net.restore(original, owner)
    except Exception as e:  # noqa: BLE001 - said in the answer; the scheduler must live
        logger.exception("sglang-trtllm-moe: restoring the served weights failed")
        return (
            False,
            f"{message}\nsglang-trtllm-moe could not restore the previous weights ({type(e).__name__}: {e}): "
            "the served weights are partly the new checkpoint's; load a good checkpoint",
            *rest,
        )
    logger.warning("sglang-trtllm-moe: a disk update failed; the previous weights are served again (%s)", how)
    return False, f"{message}\nsglang-trtllm-moe: the previous weights are served again, bit for bit ({how})", *rest


def remember_load_after(model, loader, *args, **kwargs):
    """SGLang's DefaultModelLoader built and loaded a model: where from (rollback.py: the first of the loads that
    reproduce its served weights)."""
    model_config = kwargs.get("model_config", args[0] if args else None)
    load_config = getattr(loader, "load_config", None)
    if model is not None and model_config is not None and load_config is not None:
        rollback.remember_load(model, getattr(model_config, "model_path", None), load_config.load_format)
    return None


def check_direct_before(model, named_tensors, *args, **kwargs):
    """load_format="direct": validate the whole list, then return every written group to checkpoint layout (SGLang
    copies whole parameters; the entry point's flush prepares them again)."""
    named_tensors = list(named_tensors)
    rollback.forget(model)
    with request.for_model(model) as req:
        for layer, name in req.check(model, named_tensors, direct=True).writes:
            layer_state.before_write(layer, name, None)
    return (model, named_tensors, *args), kwargs


# (dotted path, releases): where each release keeps its weight-update entry points (read from each release's
# model_runner.py / model_runner_components/weight_updater.py; the ranges are compat/features.py's WEIGHT_UPDATER
# and DISTRIBUTED_UPDATE_RENAMED).
_UPDATER, _RUNNER = features.WEIGHT_UPDATER.releases, features.WEIGHT_UPDATER.before
LOAD_ONLY_ENTRY_POINTS = (
    (f"{UPDATER}.update_weights_from_tensor", _UPDATER),
    (f"{UPDATER}.update_weights_from_distributed", f"{_UPDATER},{features.DISTRIBUTED_UPDATE_RENAMED.before}"),
    (f"{UPDATER}.load_weights_from_distributed", features.DISTRIBUTED_UPDATE_RENAMED.releases),
    (f"{UPDATER}.update_weights_from_ipc", _UPDATER),
    (f"{MODEL_RUNNER}.update_weights_from_tensor", _RUNNER),
    (f"{MODEL_RUNNER}.update_weights_from_distributed", _RUNNER),
    (f"{MODEL_RUNNER}.update_weights_from_ipc", _RUNNER),
)
RELOAD_START = (
    (f"{UPDATER}.update_weights_from_disk", _UPDATER),
    (f"{MODEL_RUNNER}.update_weights_from_disk", _RUNNER),
)


DEFAULT_LOADER = "sglang.srt.model_loader.loader.DefaultModelLoader.load_model"

DIRECT = (
    ("sglang.srt.model_executor.model_runner_components.weight_updater._model_load_weights_direct", _UPDATER),
    ("sglang.srt.model_executor.model_runner._model_load_weights_direct", _RUNNER),
)


@hookimpl
def register_sglang_hooks(register, release):
    for target, rel in LOAD_ONLY_ENTRY_POINTS:
        register(
            HookTarget(
                target,
                check_buckets_around,
                "around",
                releases=rel,
                capability="rl-update",
                group="update-entry",
                why="validate a whole update bucket before any of it is written (never a partial write)",
            )
        )
    for target, rel in RELOAD_START:
        register(
            HookTarget(
                target,
                check_disk_around,
                "around",
                releases=rel,
                capability="rl-update",
                group="update-entry",
                why="refuse a malformed checkpoint (headers, sizes, every scale's values) before SGLang restores or "
                "loads any layer, and put the served weights back if the load still fails",
            )
        )
    register(
        HookTarget(
            DEFAULT_LOADER,
            remember_load_after,
            "after",
            capability="rl-update",
            group="rollback",
            why="remember the checkpoint a model was loaded from: a failed disk update reloads it (rollback.py)",
        )
    )
    for target, rel in DIRECT:
        register(
            HookTarget(
                target,
                check_direct_before,
                "before",
                releases=rel,
                capability="rl-update",
                group="update-entry",
                why="validate whole-parameter writes and return their groups to checkpoint layout first",
            )
        )
    for target, rel in LOAD_ONLY_ENTRY_POINTS:
        register(
            HookTarget(
                target,
                flush_after,
                "after",
                releases=rel,
                capability="rl-update",
                group="update-entry",
                why="prepare the experts this update wrote (load_weights alone never does)",
            )
        )
    for target, rel in RELOAD_START + LOAD_ONLY_ENTRY_POINTS:
        register(
            HookTarget(
                target,
                drop_caches_before,
                "before",
                releases=rel,
                capability="rl-update",
                group="update-entry",
                why="drop cached layout index maps so none survives a pause/resume",
            )
        )
