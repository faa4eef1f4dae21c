"""One laid-out parameter of a MoE layer as one side of a weight-checker comparison holds it (`ParamSide`): the live
layer (`live_side`) or a snapshot of it (`snapshot_side`), with the format, the experts it holds prepared, and the
chunked copies back to checkpoint layout that the comparisons (checker.py) read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .formats.base import WeightFormat

#: scratch per side and chunk of experts (SGLang's checker chunks at 64 Mi elements)
CHUNK_BYTES = 64 << 20


@dataclass
class ParamSide:
    """A laid-out weight of a managed layer as one side holds it: the group's tensors and which experts are in
    kernel layout. The layer supplies geometry (gated, row maps) and nothing else: its own tensors are not read."""

    layer: Any
    fmt: WeightFormat
    name: str
    #: every laid-out parameter of the weight's group (the gated row map mixes them), full expert range
    tensors: dict[str, torch.Tensor]
    #: bool[E]: experts whose bytes are in kernel layout on this side
    prepared: torch.Tensor

    @property
    def group(self) -> str:
        g = self.fmt.group_of(self.name)
        if g is None:  # live_side only builds sides of laid-out parameters
            raise ValueError(f"{self.name} is not a laid-out parameter of {self.fmt.name}")
        return g

    @property
    def scale_name(self) -> str | None:
        return self.fmt.scale_of(self.name)

    @property
    def compared(self) -> tuple[str, ...]:
        """The parameters this entry covers: the weight and its block scales."""
        return (self.name,) if self.scale_name is None else (self.name, self.scale_name)

    @property
    def num_experts(self) -> int:
        return self.tensors[self.name].shape[0]


def group_names(fmt: WeightFormat, name: str) -> tuple[str, ...]:
    g = fmt.group_of(name)
    return tuple(p.name for p in fmt.params if p.group == g)


def _as_laid_out(fmt: WeightFormat, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` (a parameter's data or a snapshot of it) seen as [experts, rows, cols], as the format's layouts work on
    it (BF16 shows prepared parameters 4-D)."""
    from types import SimpleNamespace

    p = next(q for q in fmt.params if q.name == name)
    return fmt.tensor(SimpleNamespace(**{name: t}), p)


def live_side(layer, name: str) -> ParamSide:
    """The layer's own parameters and layout state right now."""
    from .layer_state import layer_name, state_of

    st = state_of(layer)
    if st is None:
        raise ValueError(f"{layer_name(layer)} is not managed by sglang-trtllm-moe: no TRT-LLM layout to undo")
    group = st.fmt.group_of(name)
    if group is None:
        raise ValueError(f"{layer_name(layer)}: {name} is not a laid-out parameter of {st.fmt.name}")
    with st.lock:  # the mask and the bytes it describes, as one writer-free moment
        tensors = {n: _as_laid_out(st.fmt, n, getattr(layer, n).data) for n in group_names(st.fmt, name)}
        return ParamSide(layer, st.fmt, name, tensors, st.prepared[group].clone())


def snapshot_side(
    layer, name: str, tensors: dict[str, torch.Tensor], prepared: torch.Tensor | None = None, checkpoint: bool = False
) -> ParamSide:
    """Other tensors of the same layer (a snapshot, or checkpoint-layout tensors with `checkpoint=True`)."""
    live = live_side(layer, name)
    missing = [n for n in live.tensors if n not in tensors]
    if missing:
        raise ValueError(f"{name}: the snapshot lacks {missing} (the whole group {tuple(live.tensors)} is needed)")
    if checkpoint:
        prepared = torch.zeros_like(live.prepared)
    elif prepared is None:
        prepared = live.prepared
    return ParamSide(
        layer,
        live.fmt,
        name,
        {n: _as_laid_out(live.fmt, n, tensors[n]) for n in live.tensors},
        prepared.clone().bool().cpu(),
    )


class _Shadow:
    """The layer, with its group's parameters replaced by our copies: lets the format's own `unprepare_` (the
    exact inverse the plugin uses for weight updates) run on scratch instead of the live weights."""

    def __init__(self, layer, tensors: dict[str, torch.Tensor]):
        self.__dict__["_layer"] = layer
        self.__dict__["_tensors"] = tensors

    def __getattr__(self, name):
        t = self.__dict__["_tensors"].get(name)
        return t if t is not None else getattr(self.__dict__["_layer"], name)


def undo_layout_(side: ParamSide, s: int, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In place on copies of experts [s, s+k): back to checkpoint layout where `side` holds them prepared."""
    k = next(iter(chunk.values())).shape[0]
    ids = side.prepared[s : s + k].nonzero().flatten().tolist()
    if ids:
        side.fmt.unprepare_(_Shadow(side.layer, chunk), side.group, ids)
    return chunk


def copy_chunk(side: ParamSide, s: int, t: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {n: x[s:t].to(device=device, copy=True).contiguous() for n, x in side.tensors.items()}


def device_of(*sides: ParamSide) -> torch.device:
    for side in sides:
        for x in side.tensors.values():
            if x.is_cuda:
                return x.device
    if torch.cuda.is_available():  # a CPU snapshot on a GPU host: compare on the GPU, like SGLang does
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def expert_chunks(side: ParamSide) -> list[tuple[int, int]]:
    e = side.num_experts
    per_expert = sum(x[0].numel() * max(x.element_size(), 4) for x in side.tensors.values()) if e else 1
    k = max(1, CHUNK_BYTES // max(1, per_expert))
    return [(s, min(s + k, e)) for s in range(0, e, k)]
