"""The sandbox's test-only switch, in a module of its own: the extension (`extension.py`) reads it in every process
SGLang starts before anything else of the sandbox is imported, and `activation.py` acts on it."""

from __future__ import annotations

#: the SM every process SGLang starts fakes (with SGLANG_TRTLLM_MOE_EMULATE=1; SM100 only)
ENV_FAKE_SM = "SGLANG_TRTLLM_MOE_TEST_FAKE_SM"

__all__ = ["ENV_FAKE_SM"]
