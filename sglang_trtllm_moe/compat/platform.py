"""How each SGLang release says what GPU this is, how to fake one, and how to read a resolved ServerArgs.

The selection hook asks "is this SM 10.x?" the way SGLang itself asks it, so a platform faked for tests (or a
platform plugin) gives the plugin and SGLang the same answer. One adapter per release range:

* >= 0.5.23: `sglang.srt.runtime_context.get_platform()` / `override_platform(**facts)`; ServerArgs resolves in
  `resolve_once()` and the answer is `resolved_dict()["moe_runner_backend"]` (the raw field stays as given).
* 0.5.16 – 0.5.18 (not built here): resolution runs in `ServerArgs.__post_init__` through
  `sglang.srt.arg_groups.overrides`, which imports `is_sm100_supported` by name — fake by monkeypatching
  `arg_groups.overrides.is_sm100_supported` and `server_args.is_sm100_supported`; read
  `arg_groups.overrides.resolved_view(sa).moe_runner_backend`.
* <= 0.5.14 (not built here): `ServerArgs._handle_model_specific_adjustments` in `__post_init__`; monkeypatch
  `sglang.srt.server_args.is_sm100_supported`; read `sa.moe_runner_backend`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..selection import DeviceInfo, flashinfer_version
from .releases import installed_version

#: Platform facts SGLang 0.5.23 reads (`runtime_context._PLATFORM_PROBES`), per faked SM. Every flag is given
#: explicitly so a faked SM90 on a real Blackwell box still reads as SM90.
_FLAGS = ("is_sm90", "is_sm100", "is_sm100_or_sm110", "is_sm110", "is_sm120", "is_blackwell", "is_hopper_with_cuda_12_3")


def platform_facts(sm: int) -> dict:
    major, minor = divmod(int(sm), 10)
    facts = {f: False for f in _FLAGS}
    if major == 10:
        facts.update(is_sm100=True, is_sm100_or_sm110=True, is_blackwell=True)
    elif major == 11:
        facts.update(is_sm110=True, is_sm100_or_sm110=True, is_blackwell=True)
    elif major == 12:
        facts.update(is_sm120=True, is_blackwell=True)
    elif major == 9:
        facts.update(is_sm90=True)
    facts["device_capability"] = (major, minor)
    facts["device_sm"] = int(sm)
    return facts


def _release() -> Version:
    v = installed_version()
    if v is None:
        raise RuntimeError("sglang is not installed")
    return Version(v.base_version)


def _supported_here(what: str) -> None:
    if _release() not in SpecifierSet(">=0.5.23"):
        raise NotImplementedError(
            f"{what} for sglang {_release()} is not implemented (only >= 0.5.23); see compat/platform.py for "
            "what older releases need"
        )


@contextlib.contextmanager
def fake_platform(sm: int) -> Iterator[None]:
    """SGLang sees an SM `sm` GPU inside the block (CPU tests, `explain --sm`)."""
    _supported_here("faking the platform")
    from sglang.srt.runtime_context import override_platform

    with override_platform(**platform_facts(sm)):
        yield


def device_from_sglang() -> DeviceInfo:
    """The device as SGLang's platform facts describe it (honours `override_platform`)."""
    _supported_here("reading the platform")
    from sglang.srt.runtime_context import get_platform

    p = get_platform()
    sm = None
    cap = None
    try:
        cap = p.device_capability
    except Exception:  # noqa: BLE001 - no device: the yes/no facts below still answer
        cap = None
    major = cap[0] if isinstance(cap, tuple) and cap and isinstance(cap[0], int) else None
    minor = cap[1] if major is not None and len(cap) > 1 and isinstance(cap[1], int) else 0
    for flag, fam in (("is_sm100", 10), ("is_sm110", 11), ("is_sm120", 12), ("is_sm90", 9)):
        try:
            if getattr(p, flag):
                sm = fam * 10 + (minor if major == fam else 0)
                break
        except Exception:  # noqa: BLE001
            continue
    if sm is None and major is not None:
        sm = major * 10 + minor
    return DeviceInfo(sm=sm, flashinfer_version=flashinfer_version(), source="sglang-platform")


def resolve_server_args(server_args: Any) -> dict:
    """Run SGLang's own resolution on `server_args` and return the resolved fields."""
    _supported_here("resolving ServerArgs")
    server_args.resolve_once()
    return server_args.resolved_dict()


def resolved_moe_runner_backend(server_args: Any) -> str:
    return resolve_server_args(server_args)["moe_runner_backend"]


__all__ = ["device_from_sglang", "fake_platform", "platform_facts", "resolve_server_args", "resolved_moe_runner_backend"]
