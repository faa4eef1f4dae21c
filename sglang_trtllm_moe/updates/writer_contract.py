"""The layout contract for writers that bypass the loader (P2P / RDMA inside a weight-update session).

While a session is open (after `begin_weight_update`) every managed layer — or every expert the writer's hint names
(updates/session_writes.py) — is in **checkpoint layout**: each parameter holds, per expert slot, exactly the bytes
SGLang's own `FusedMoE.weight_loader` of the running release leaves there when it loads the checkpoint (its TP
narrowing, the intermediate padded per half and zero-filled, its w1 / w3 order, the per-tensor scales' positions).
A writer writes those bytes; at `end` the plugin checks the values a load would refuse (updates/loader_free.py),
lays each written expert out for the kernel in place and recomputes the derived values (the kernel scalars, and
the scalar parameters a format rewrites itself). Anything written outside a session lands on kernel-layout bytes.

`writer_contract(model)` says it for a loaded model, per layer the plugin manages or watches and per parameter:
shape and dtype (the writer's registration must match them), what kind of value it holds and the rule its values
must satisfy, where each checkpoint shard's bytes go inside an expert's slot — traced from SGLang's own
`_weight_loader_impl` on meta tensors (updates/slot_plans.py), so it is this release's answer, not a description of
it — what the plugin does to it at `end`, and what it recomputes. `render(...)` prints it;
`format_contract(fmt)` is the part that holds for every layer of a format (`sglang-trtllm-moe explain
--writer-contract`, which has no loaded model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layer_state
from ..formats.base import WeightFormat
from ..formats.load_rules import BLOCK_SCALE
from . import layer_params, slot_plans, value_checks
from .write_plans import ShapeRule, shards_of

#: what the plugin does to a laid-out parameter at the end of a session, by its ParamLayout flags
_LAYOUT_STEPS = (
    ("permute_rows", "its rows reordered for the kernel ({rows})"),
    ("sf_swizzle", "the 128x4 scale-factor swizzle"),
    ("block_major_k", "the BlockMajorK blocking"),
)
_ROWS = {
    "w13": "the two halves interleaved where gated, then the kernel's row shuffle",
    "w2": "the kernel's row shuffle",
}


@dataclass(frozen=True)
class Placement:
    """One write of SGLang's loader into an expert's slot of a parameter: `dst` (index ranges of the slot) gets
    `src` (index ranges of the checkpoint's `shard` tensor of that expert, this rank's part) or `value`."""

    shard: str
    #: (start, stop) per dimension of the slot
    dst: tuple[tuple[int, int], ...]
    #: (start, stop) per dimension of the checkpoint tensor (None: a fill)
    src: tuple[tuple[int, int], ...] | None
    value: float | int | bool | None = None

    @staticmethod
    def index(ranges: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
        """`dst` / `src` as an index of a tensor."""
        return tuple(slice(a, b) for a, b in ranges)


@dataclass(frozen=True)
class ParamContract:
    name: str
    shape: tuple[int, ...]
    dtype: str
    #: weight | block_scale | tensor_scale | input_scale (formats/load_rules.py KINDS)
    kind: str
    #: the rule its values must satisfy (None: data, not checked)
    values: str | None
    #: per checkpoint shard: where its bytes go inside one expert's slot (SGLang's loader, traced), as text
    writes: tuple[str, ...]
    #: the same, as index ranges (empty where SGLang's loader does more than copy, or writes every expert at once)
    placement: tuple[Placement, ...]
    #: what the plugin does to it at the end of the session
    at_end: str


@dataclass(frozen=True)
class LayerContract:
    layer: str
    format: str
    #: "plugin" (the plugin lays it out) or "sglang" (SGLang prepares it; the plugin checks the values)
    owner: str
    #: local expert slots, and the global slot of the first (the hint's numbering)
    experts: int
    first_slot: int
    params: tuple[ParamContract, ...]
    #: derived values the plugin (or SGLang) recomputes at the end: a writer does not write them
    recomputed: tuple[str, ...]


def _steps(fmt: WeightFormat, name: str) -> str:
    for p in fmt.params:
        if p.name == name:
            steps = [text.format(rows=_ROWS[p.group]) for flag, text in _LAYOUT_STEPS if getattr(p, flag)]
            return "laid out in place for the kernel: " + ", then ".join(steps) if steps else "kept as written"
    if name in fmt.recomputed_params:
        return "recomputed (what was written is not read)"
    return "kept as written; read by the kernel scalars"


def format_contract(fmt: WeightFormat) -> list[dict]:
    """What holds for every layer of `fmt`: per parameter, its kind, whether its values are checked, and what the
    plugin does at the end of a session (no shapes: those need a loaded model, `writer_contract`)."""
    out = []
    for name in (*(p.name for p in fmt.params), *fmt.scalar_params):
        rule = fmt.load_rule(name)
        if rule is None:
            continue
        checked = rule.kind == BLOCK_SCALE or rule.scalar
        out.append(
            {
                "param": name,
                "group": rule.group,
                "kind": rule.kind,
                "values_checked": checked and name not in fmt.recomputed_params,
                "at_end": _steps(fmt, name),
            }
        )
    return out


def _slices(g: slot_plans.Geometry, shape: tuple) -> tuple[tuple[int, int], ...]:
    """A view of a contiguous tensor of `shape` (its element offset and extents) as index ranges."""
    idx, rest = [], g.offset
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    for st in strides:
        idx.append(rest // st)
        rest %= st
    lead = len(shape) - len(g.shape)  # a view of fewer dims: its leading indices are single
    return tuple((start, start + (g.shape[d - lead] if d >= lead else 1)) for d, start in enumerate(idx))


def _text(ranges: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in ranges) + "]" if ranges else "its value"


def _placement(
    layer, fmt, name: str, param, view: torch.Tensor, rule, gated: bool, placed: list[Placement]
) -> tuple[str, ...]:
    """Per shard: SGLang's loader's writes of one checkpoint tensor into one slot of `param`, seen as `view` (its
    checkpoint-layout shape: [experts, rows, cols] where a release shows the laid-out parameter in another one)."""
    probe = torch.nn.Parameter(torch.empty(tuple(view.shape), dtype=view.dtype, device="meta"), requires_grad=False)
    probe.__dict__.update(param.__dict__)  # weight_loader, quant_method, ... (what SGLang's loader reads)
    slot_shape = tuple(view.shape[1:])
    if fmt.fused:
        return ("every expert at once: SGLang's loader copies the checkpoint's all-expert tensor into it",)
    out = []
    for shard in shards_of(rule, gated):
        if rule.scalar:
            loaded_shape: tuple = ()
        elif view.dim() == 3:
            sr = ShapeRule(layer, fmt, rule, view, gated)
            split = min(sr.extents) if isinstance(sr.extents, tuple) else sr.extents[-1]  # the checkpoint's size
            loaded_shape = (split, sr.fixed) if sr.fixed_dim == 1 else (sr.fixed, split)
        else:
            out.append(f"{shard}: a [{', '.join(map(str, slot_shape))}] slot per expert (no traced placement)")
            continue
        loaded = torch.empty(loaded_shape, dtype=view.dtype, device="meta")
        plan = slot_plans.slot_plan(layer, probe, f"experts.0.{name}", shard, loaded)
        if plan is None:
            out.append(f"{shard}: SGLang's loader does more than copy here (no traced placement)")
            continue
        ops = []
        for op in plan.ops:
            dst = _slices(op.dst, slot_shape)
            if op.kind == "copy":
                src = _slices(op.src, loaded_shape)
                placed.append(Placement(shard, dst, src))
                what = f"{_text(src)} of the" if loaded_shape else "the"
                ops.append(f"{_text(dst)} <- {what} checkpoint's {shard} {list(loaded_shape) or 'scalar'}")
            else:
                value = 0 if op.kind == "zero" else op.value
                placed.append(Placement(shard, dst, None, value))
                ops.append(f"{_text(dst)} = {value}")
        out.append(f"{shard}: " + "; ".join(ops))
    return tuple(out)


def _params(layer, fmt: WeightFormat) -> tuple[ParamContract, ...]:
    gated = fmt.is_gated(layer)
    out = []
    created = dict(layer.named_parameters(recurse=False))
    for name in (*(p.name for p in fmt.params), *fmt.scalar_params):
        rule = fmt.load_rule(name)
        param = created.get(name)
        if rule is None or param is None or name in fmt.recomputed_params:
            continue
        code = rule.value_rule(param.dtype)
        view = layer_params.param_view(layer, fmt, name, param)
        placed: list[Placement] = []
        writes = _placement(layer, fmt, name, param, view, rule, gated, placed)
        out.append(
            ParamContract(
                name=name,
                shape=tuple(view.shape),
                dtype=str(param.dtype).replace("torch.", ""),
                kind=rule.kind,
                values=value_checks.EXPECTED[code] if code is not None else None,
                writes=writes,
                placement=tuple(placed),
                at_end=_steps(fmt, name),
            )
        )
    return tuple(out)


def writer_contract(model) -> list[LayerContract]:
    """The contract of every MoE layer of `model` the plugin manages or watches (see the module docstring)."""
    out = []
    for module in model.modules():
        st = layer_state.state_of(module)
        fmt = st.fmt if st is not None else layer_state.observed(module)
        if fmt is None:
            continue
        e = int(fmt.tensor(module, fmt.params[0]).shape[0])
        scalars = st.kernel_scalars if st is not None and st.kernel_scalars else tuple(fmt.compute_scalars(module))
        out.append(
            LayerContract(
                layer=layer_state.layer_name(module),
                format=fmt.name,
                owner="plugin" if st is not None else "sglang",
                experts=e,
                first_slot=int(getattr(module, "moe_ep_rank", 0) or 0) * e,
                params=_params(module, fmt),
                recomputed=(*scalars, *fmt.recomputed_params),
            )
        )
    return out


def render(contract: list[LayerContract]) -> str:
    """The contract as text: layers of one format and geometry once, with the names of the others."""
    groups: dict[tuple, list[str]] = {}
    for c in contract:
        key = (c.format, c.owner, c.experts, c.first_slot, c.params, c.recomputed)
        groups.setdefault(key, []).append(c.layer)
    lines = []
    for (fmt, owner, e, first, params, recomputed), names in groups.items():
        who = "laid out by sglang-trtllm-moe" if owner == "plugin" else "prepared by SGLang, values checked"
        lines.append(f"{fmt} ({who}): {len(names)} layer(s): {', '.join(names)}")
        lines.append(f"  expert slots {first} .. {first + e - 1} on this rank ({e} local; the hint's numbering)")
        for p in params:
            rule = f"values: {p.values}" if p.values else "values: data (not checked)"
            lines.append(f"  {p.name} {list(p.shape)} {p.dtype} ({p.kind}; {rule})")
            for w in p.writes:
                lines.append(f"    write {w}")
            lines.append(f"    at the end of the session: {p.at_end}")
        lines.append(f"  recomputed at the end (not written): {', '.join(recomputed) or 'nothing'}")
    return "\n".join(lines)


__all__ = ["LayerContract", "ParamContract", "Placement", "format_contract", "render", "writer_contract"]
