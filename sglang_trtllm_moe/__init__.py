"""sglang-trtllm-moe: FlashInfer TRT-LLM-Gen fused MoE for SGLang on Blackwell, as an out-of-tree plugin.

The import is kept cheap (no torch, no sglang): SGLang imports this package in every process through its
`sglang.srt.plugins` entry point, and most processes never touch an MoE layer.
"""

import pluggy

from .errors import KernelUnavailableError, TrtllmLayerError, WeightPrepError, WeightUpdateRefused

__version__ = "0.1.0"

PROJECT_NAME = "sglang_trtllm_moe"

#: Marker for implementations of the plugin's own hook specifications (see `hookspecs`).
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


def writer_contract(model, text: bool = True):
    """The layout contract of `model`'s MoE layers for writers that bypass the loader (P2P / RDMA inside a weight-
    update session): per layer and parameter, its shape and dtype, the rule its values must satisfy, where each
    checkpoint shard's bytes go in an expert's slot (traced from the running SGLang's own loader), and what the
    plugin lays out and recomputes at the end of the session. `text`: rendered (else the records,
    updates/writer_contract.py)."""
    from .updates import writer_contract as contract

    records = contract.writer_contract(model)
    return contract.render(records) if text else records


def expect_session_writes(experts) -> None:
    """In this process: the next weight-update session writes only `experts` ({layer prefix or "*": [expert slots]})
    — its begin returns only those to checkpoint layout, its end checks and lays out only those
    (updates/session_writes.py). From outside the scheduler: `session_writes_rid(experts)` as the begin request's
    `rid`, or `begin_session(engine, experts)`."""
    from .updates import session_writes

    session_writes.expect(experts)


def session_writes_rid(experts) -> str:
    """The `rid` of a `/begin_weight_update` request (`BeginWeightUpdateReqInput`) that says which experts the
    session writes."""
    from .updates import session_writes

    return session_writes.rid(experts)


def begin_session(engine, experts, selector: str = "all"):
    """`sglang.Engine.begin_weight_update(selector)` saying which experts the session writes."""
    from .updates import session_writes

    return session_writes.begin(engine, experts, selector)


__all__ = [
    "__version__",
    "PROJECT_NAME",
    "hookimpl",
    "begin_session",
    "expect_session_writes",
    "session_writes_rid",
    "writer_contract",
    "TrtllmLayerError",
    "WeightUpdateRefused",
    "WeightPrepError",
    "KernelUnavailableError",
]
