"""The plugin's own extension points (pluggy hook specifications).

Built-in capabilities implement these exactly as third-party extensions do (registered from the
`sglang_trtllm_moe` entry-point group), so an extension can add an SGLang hook target the same way we do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

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
