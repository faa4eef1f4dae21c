"""How each SGLang release says what GPU this is, how to fake one, and how a resolution choice is written and read.

The selection hook asks "is this SM 10.x?" the way SGLang itself asks it, so a platform faked for tests (or a
platform plugin) gives the plugin and SGLang the same answer. The decision itself is release-independent
(`selection.resolve`); only where SGLang resolves `--moe-runner-backend` and how a choice is declared differ,
and that difference lives in `ADAPTERS` (one row per release range):

* >= 0.5.19 ("pipeline"): `ServerArgs.resolve_once()` runs `arg_groups.pipeline`; the step is
  `arg_groups.moe_hook.handle_moe_kernel_config`; a choice is declared with `overrides.declare_resolution`; the
  platform is `runtime_context.get_platform()` / `override_platform(**facts)` (each release knows its own fact
  names: 0.5.19-0.5.21 have no `is_sm110`); the answer is `resolved_dict()["moe_runner_backend"]`.
* 0.5.11 – 0.5.18 ("post_init"): resolution runs in `ServerArgs.__post_init__`; the step is the method
  `ServerArgs._handle_moe_kernel_config` (after the model rules, before SGLang's own quantization rules and asserts);
  the platform is the `lru_cache`d `is_sm*_supported` probes, imported by name into many modules — faked by
  rebinding every loaded reference; the answer is the field. How a choice is written differs inside that range:
  - 0.5.15 – 0.5.18: `_handle_moe_kernel_config` reads `overrides.resolved_view`; a choice is declared the way
    SGLang's own post-process passes declare theirs (`overrides.run_post_process_pass`: the `_resolved_overrides`
    stash, materialized at the end of `__post_init__`), and the field keeps the user's own value until then;
  - 0.5.11 – 0.5.14 (features.SERVER_ARGS_FIELD_WRITES): every rule assigns the fields in place (no declarations,
    no view), and the model rules overwrite `moe_runner_backend` before `_handle_moe_kernel_config`; the user's own
    value is recorded on the ServerArgs before them (`REQUESTED_ATTR`, by a BEFORE hook on
    `_handle_model_specific_adjustments`), and the plugin's choice is assigned to the field as SGLang's rules do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import layer_attrs
from . import features
from .releases import installed_version

#: <= 0.5.14: what the caller asked for, recorded on the ServerArgs before SGLang's model rules overwrite the fields
REQUESTED_ATTR = layer_attrs.REQUESTED
#: ... recorded BEFORE this step (the first one that may write moe_runner_backend)
RECORD_TARGET = "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments"


def _release() -> Version:
    v = installed_version()
    if v is None:
        raise RuntimeError("sglang is not installed")
    return Version(v.base_version)


@dataclass(frozen=True)
class ReleaseAdapter:
    """Where one release range resolves the MoE runner, and how the plugin's choice goes back into it."""

    releases: str
    #: "pipeline" | "post_init" (see the module docstring)
    kind: str
    #: the resolution step the selection hook runs BEFORE (SGLang's own step then validates our choice)
    hook_target: str


ADAPTERS: tuple[ReleaseAdapter, ...] = (
    ReleaseAdapter(">=0.5.19", "pipeline", "sglang.srt.arg_groups.moe_hook.handle_moe_kernel_config"),
    ReleaseAdapter(">=0.5.11,<0.5.19", "post_init", "sglang.srt.server_args.ServerArgs._handle_moe_kernel_config"),
)


def adapter(release: Version | None = None) -> ReleaseAdapter:
    release = _release() if release is None else Version(release.base_version)
    for a in ADAPTERS:
        if release in SpecifierSet(a.releases):
            return a
    raise NotImplementedError(
        f"sglang {release}: no resolution adapter (auto-select serves {', '.join(a.releases for a in ADAPTERS)})"
    )


# --- reading and writing the resolving ServerArgs ------------------------------------------------------------


def resolved_view(server_args: Any):
    """SGLang's read-only view of the half-resolved config (declarations overlaid); <= 0.5.14 the fields are it."""
    if features.SERVER_ARGS_FIELD_WRITES.present():
        return server_args
    from sglang.srt.arg_groups import overrides

    return overrides.resolved_view(server_args)


def model_config_of(server_args: Any):
    if not features.SERVER_ARGS_FIELD_WRITES.present():
        from sglang.srt.arg_groups import overrides

        if hasattr(overrides, "model_config_of"):
            return overrides.model_config_of(server_args)
    return server_args.get_model_config()


def record_requested(server_args: Any) -> None:
    """<= 0.5.14: keep what the caller asked for before SGLang's model rules assign the fields."""
    object.__setattr__(
        server_args,
        REQUESTED_ATTR,
        {f: getattr(server_args, f, None) for f in ("moe_runner_backend", "speculative_moe_runner_backend")},
    )


def requested_field(server_args: Any, field: str) -> Any:
    """What the caller asked for in `field`, before any resolution rule ran. 0.5.19+: the pipeline's `_raw_input`
    snapshot (taken before any handler runs; SGLang's own `overrides` reads it the same way). 0.5.15-0.5.18: the
    field itself — those releases' rules declare into the stash and materialize only at the end of __post_init__.
    <= 0.5.14: the value recorded before the model rules (`record_requested`), else the field."""
    raw = getattr(server_args, "_raw_input", None) or getattr(server_args, REQUESTED_ATTR, None) or {}
    return raw.get(field, getattr(server_args, field, None))


def backend_requested() -> str | None:
    """The --moe-runner-backend the user asked for, as this process's published ServerArgs hold it (a scheduler's
    config); None when no config is published or it cannot be read. On 0.5.19+ the raw input is kept apart from
    the resolution, so "auto" means the backend was chosen by a rule (SGLang's or the plugin's). Before, the
    resolution writes the field itself, so a rule's choice reads as requested: the plugin then treats a layer the
    kernels cannot serve as forced onto them (a clear error) rather than handing it back."""
    server_args = published_server_args()
    value = requested_field(server_args, "moe_runner_backend") if server_args is not None else None
    return None if value is None else str(getattr(value, "value", value))


def published_server_args() -> Any:
    """This process's published ServerArgs (a scheduler's config), or None when none is published or it cannot be
    read (a bare layer in a script)."""
    try:
        if features.PUBLISHED_SERVER_ARGS.present():
            from sglang.srt.runtime_context import get_server_args

            return get_server_args()
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - nothing published: unknown
        return None


def returns_routed_experts() -> bool:
    """Is `--enable-return-routed-experts` on in this process's published ServerArgs (False when unknown)?"""
    server_args = published_server_args()
    return bool(getattr(server_args, "enable_return_routed_experts", False)) if server_args is not None else False


def weight_cache_mode(server_args: Any = None) -> str:
    """--weight-cache-mode of `server_args` (default: this process's published ServerArgs): "off", "daemon" or
    "client"; "off" when unknown or on releases without it (features.WEIGHT_CACHE)."""
    if not features.WEIGHT_CACHE.present():
        return "off"
    if server_args is None:
        server_args = published_server_args()
    return str(getattr(server_args, "weight_cache_mode", None) or "off")


def declare_choice(server_args: Any, source: str, **fields: Any) -> None:
    """Write the plugin's choice the way this release's own resolution rules write theirs."""
    if features.SERVER_ARGS_FIELD_WRITES.present():  # <= 0.5.14: SGLang's own rules assign the fields in place
        for k, v in fields.items():
            setattr(server_args, k, v)
        return
    from sglang.srt.arg_groups import overrides

    if adapter().kind == "pipeline":
        overrides.declare_resolution(server_args, source, **fields)
        return

    # 0.5.15-0.5.18: a post-process pass declares into the `_resolved_overrides` stash under its __qualname__
    # (validated there, materialized at the end of __post_init__); ours declares exactly `fields`.
    def declare(view):
        return dict(fields)

    declare.__qualname__ = source
    overrides.run_post_process_pass(server_args, declare)


# --- the platform as SGLang describes it ---------------------------------------------------------------------


def _sm_from_probes() -> int | None:
    from sglang.srt.utils import common

    for flag, fam in (("is_sm100_supported", 10), ("is_sm120_supported", 12), ("is_sm90_supported", 9)):
        try:
            if getattr(common, flag)():
                sm = common.get_device_sm()
                return sm if sm and sm // 10 == fam else fam * 10
        except Exception:  # noqa: BLE001 - no device: try the next probe
            continue
    return None


def sm_from_sglang() -> tuple[int | None, str]:
    """The device's SM as SGLang's platform facts describe it (honours `override_platform` / the rebound probes),
    and which facts said it ("sglang-platform" or "sglang-probes"); `selection_hooks.device_from_sglang` makes it a
    `selection.DeviceInfo`."""
    if not features.PLATFORM_OVERRIDE.present():
        return _sm_from_probes(), "sglang-probes"
    from sglang.srt.runtime_context import get_platform

    p = get_platform()
    sm = None
    cap = None
    try:
        cap = p.device_capability
    except Exception:  # noqa: BLE001 - no device: the yes/no facts below still answer
        cap = None
    cap_t = cap if isinstance(cap, tuple) else ()
    major = cap_t[0] if cap_t and isinstance(cap_t[0], int) else None
    minor = cap_t[1] if major is not None and len(cap_t) > 1 and isinstance(cap_t[1], int) else 0
    for flag, fam in (("is_sm100", 10), ("is_sm110", 11), ("is_sm120", 12), ("is_sm90", 9)):
        try:
            if getattr(p, flag):
                sm = fam * 10 + (minor if major == fam else 0)
                break
        except Exception:  # noqa: BLE001 - a fact this release does not know
            continue
    if sm is None and major is not None:
        sm = major * 10 + minor
    return sm, "sglang-platform"


def resolve_server_args(server_args: Any) -> dict:
    """Run SGLang's own resolution on `server_args` and return the resolved fields."""
    if adapter().kind == "post_init":  # resolved in __post_init__ already; the fields carry the answer
        import dataclasses

        return {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}
    server_args.resolve_once()
    return server_args.resolved_dict()


def resolved_moe_runner_backend(server_args: Any) -> str:
    return resolve_server_args(server_args)["moe_runner_backend"]


__all__ = [
    "ADAPTERS",
    "RECORD_TARGET",
    "REQUESTED_ATTR",
    "ReleaseAdapter",
    "adapter",
    "backend_requested",
    "record_requested",
    "declare_choice",
    "model_config_of",
    "published_server_args",
    "requested_field",
    "sm_from_sglang",
    "returns_routed_experts",
    "weight_cache_mode",
    "resolve_server_args",
    "resolved_moe_runner_backend",
    "resolved_view",
]
