"""The plugin's own extension points (pluggy hook specifications).

Built-in capabilities implement these exactly as third-party extensions do (registered from the
`sglang_trtllm_moe` entry-point group), so an extension can add an SGLang hook target the same way we do, set up
the processes SGLang starts, or add a command to the `sglang-trtllm-moe` command line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from . import PROJECT_NAME

if TYPE_CHECKING:
    from packaging.version import Version

    from .targets import HookTarget

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def register_sglang_hooks(register: Callable[[HookTarget], None], release: Version) -> None:
    """Declare hooks on SGLang.

    Call ``register(HookTarget(...))`` once per target (see `sglang_trtllm_moe.targets.HookTarget`). ``release`` is
    the running SGLang `packaging.version.Version`; a target whose ``releases`` specifier excludes it is recorded as
    not applicable instead of being registered. Keep this cheap: it runs in every SGLang process at start-up.
    """


@hookspec
def process_setup(release: Version) -> str | None:
    """Set this SGLang process up, once, right after the plugin's hook targets are installed (so the modules it
    imports are hooked as they load) — in every process SGLang starts (launcher, scheduler, detokenizer).

    Return one line saying what was set up (`sglang-trtllm-moe doctor` shows it under its switches), or None when
    nothing was (the usual case: keep it cheap, import nothing heavy then). Raise to refuse a setting: the plugin
    logs the message, records it in its errors and keeps serving.
    """


@hookspec
def register_commands(subparsers: Any) -> None:
    """Add subcommands to the `sglang-trtllm-moe` command line: ``subparsers`` is its `argparse` subparsers object
    (``subparsers.add_parser(name, help=...)``; set ``func`` with ``set_defaults``: called with the parsed arguments,
    it returns the exit status). Runs at every start of the command: keep it cheap."""
