"""The sandbox as an extension of the plugin: registered in the plugin's own entry-point group (`sglang_trtllm_moe`,
this distribution's setup.cfg) exactly as a third-party extension is, it implements two of the plugin's hookspecs:

* `process_setup`: in every process SGLang starts, once the plugin's hook targets are installed, the sandbox is
  switched on when both test-only switches are set (SGLANG_TRTLLM_MOE_EMULATE=1 with
  SGLANG_TRTLLM_MOE_TEST_FAKE_SM=100: `activation.activate_from_env`), and nothing happens otherwise;
* `register_commands`: the command line's `demo`, `bench` and `tiny-checkpoint` (commands.py).

The runtime neither imports nor names the sandbox (tests/test_house_rules.py); importing this module imports
neither torch nor SGLang (it runs in every SGLang process and at every start of the command line).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .. import hookimpl
from .switches import ENV_FAKE_SM  # read before anything else of the sandbox is imported: without it, nothing more

if TYPE_CHECKING:
    from packaging.version import Version


@hookimpl
def process_setup(release: Version) -> str | None:
    if not os.environ.get(ENV_FAKE_SM, "").strip():
        return None  # the usual case: nothing imported
    from .activation import activate_from_env

    return activate_from_env()


@hookimpl
def register_commands(subparsers: Any) -> None:
    from .commands import add_commands

    add_commands(subparsers)
