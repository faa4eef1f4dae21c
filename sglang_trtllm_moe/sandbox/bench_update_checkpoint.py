"""A whole random checkpoint of the model-update benchmark (bench_update.py): a DeepSeek-V3 TinySpec scaled to a
size, every tensor with its real name, dtype and shape, filled from pools of random bytes, and the whole model in
buckets as an RL framework sends it."""

from __future__ import annotations

import torch


def model_spec(quant: str, experts: int, hidden: int, intermediate: int):
    from .checkpoints import TinySpec

    return TinySpec(
        arch="deepseek_v3",
        quant=quant,
        hidden=hidden,
        moe_intermediate=intermediate,
        dense_intermediate=2 * intermediate,
        num_experts=experts,
        top_k=min(8, experts // 4),
    )


def random_checkpoint(spec, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of `spec`'s checkpoint: the dense ones as checkpoints.py draws them, the routed experts with their
    real names, dtypes and shapes, filled from pools of random bytes (packed FP4 / FP8 bytes without NaN, positive
    finite scales; drawing every byte afresh takes minutes on a small box)."""
    from . import checkpoints as ck

    out = ck.checkpoint(spec, experts=[], dense=True)
    first = spec.moe_layers[0]
    template = ck.quantized_experts(spec, layers=[first], experts=[0])  # names, dtypes, shapes of one expert
    head = f"{ck.moe_prefix(spec, first)}.experts.0."
    pool = _Pool(seed)
    gate, up = (ck.expert_proj_names(spec)[r] for r in (ck.GATE, ck.UP))
    for layer in spec.moe_layers:
        for e in range(spec.num_experts):
            base = f"{ck.moe_prefix(spec, layer)}.experts.{e}."
            for name, t in template.items():
                tail = name[len(head) :]
                out[base + tail] = pool.like(t, tail)
            # one activation feeds gate and up: their input scales are one value (SGLang keeps one per expert)
            if f"{base}{up}.input_scale" in out:
                out[f"{base}{up}.input_scale"] = out[f"{base}{gate}.input_scale"].clone()
    return out


class _Pool:
    """Random bytes per kind (16 MiB each), handed out in consecutive slices (wrapping, each slice copied)."""

    SIZE = 16 * 2**20

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        n = self.SIZE
        fp8 = torch.randint(0, 0x7F, (n,), dtype=torch.uint8, generator=g)
        fp8 |= torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g) << 7
        self.pools = {
            "bytes": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),  # packed e2m1 pairs: any byte
            "e4m3_scale": torch.randint(0x08, 0x7F, (n,), dtype=torch.uint8, generator=g),  # positive, finite
            "fp8_weight": fp8,  # either sign, never the NaN bytes 0x7f / 0xff
            "float": torch.rand(n // 4, generator=g) * 0.01 + 1e-3,  # per-tensor / block / input scales
        }
        self.at = dict.fromkeys(self.pools, 0)

    def take(self, kind: str, n: int) -> torch.Tensor:
        src = self.pools[kind]
        out = torch.empty(n, dtype=src.dtype)
        done = 0
        while done < n:
            k = min(n - done, src.numel() - self.at[kind])
            out[done : done + k] = src[self.at[kind] : self.at[kind] + k]
            done += k
            self.at[kind] = (self.at[kind] + k) % src.numel()
        self.at[kind] = (self.at[kind] + 4099) % src.numel()  # the next tensor starts elsewhere
        return out

    def like(self, t: torch.Tensor, tail: str) -> torch.Tensor:
        n = t.numel()
        if t.dtype == torch.uint8:
            return self.take("bytes", n).reshape(t.shape)
        if t.dtype == torch.float8_e4m3fn:
            kind = "e4m3_scale" if "scale" in tail else "fp8_weight"
            return self.take(kind, n).reshape(t.shape).view(torch.float8_e4m3fn)
        return self.take("float", n).reshape(t.shape).to(t.dtype)


def bucketed(tensors: dict[str, torch.Tensor], bucket_mib: float) -> list[list[tuple[str, torch.Tensor]]]:
    """The whole model as an RL framework sends it: (name, tensor) in checkpoint order, in buckets of at most
    `bucket_mib` (a larger tensor is a bucket of its own)."""
    limit = bucket_mib * 2**20
    out: list[list] = [[]]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nb = t.numel() * t.element_size()
        if out[-1] and size + nb > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nb
    return out
