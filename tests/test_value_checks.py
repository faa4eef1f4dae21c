"""value_checks decides every byte of the 1-byte scale encodings and every special float as the elementwise rule
does, on the CPU path and on the branch-free path CUDA tensors take (one verdict tensor per tensor, read back once
per request), and a request of many tensors is read back once per device. Pure torch: runs on any device."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_trtllm_moe.formats.load_rules import E4M3_BYTES, NONNEGATIVE, POSITIVE, UE8M0_BYTES
from sglang_trtllm_moe.updates import value_checks as vc

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _expected(byte: int, rule: str) -> bool:
    """The rule from the encodings' definitions (not from value_checks): e4m3 NaN 0x7F / 0xFF, negative 0x81-0xFE
    (0x80 is -0); UE8M0 NaN 0xFF."""
    if rule == E4M3_BYTES:
        return byte in (0x7F, 0xFF) or 0x81 <= byte <= 0xFE
    return byte == 0xFF


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", [E4M3_BYTES, UE8M0_BYTES])
def test_every_byte_with_every_neighbour(rule, device):
    """Each of the 256 bytes next to a valid one, to -0 (0x80, the top valid e4m3 byte, under which a 0x7F could hide)
    and to 0x7E; both the CPU path and the branch-free device path."""
    for neighbour in (0x00, 0x7E, 0x80, 0x10):
        t = torch.tensor([[neighbour, 0x20], [0x30, 0]] * 64, dtype=torch.uint8, device=device)
        for byte in range(256):
            t[-1, -1] = byte
            want = _expected(byte, rule) or _expected(neighbour, rule)
            view = t.view(torch.float8_e4m3fn) if rule == E4M3_BYTES else t
            assert bool(vc.any_bad(view, rule)) == want, (hex(byte), hex(neighbour))
            assert (vc.find_bad([(view, rule)]) == [0]) == want, (hex(byte), hex(neighbour))
            assert bool(vc.bad_mask(view, rule).any()) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_special_floats(dtype, device):
    for v in (0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, math.nan, math.inf, -math.inf):
        for rule in (POSITIVE, NONNEGATIVE):
            x = torch.tensor(v, dtype=dtype).item()
            want = not (math.isfinite(x) and (x > 0 if rule == POSITIVE else x >= 0))
            block = torch.ones(16, 56, dtype=dtype, device=device)
            block[15, 55] = v
            assert bool(vc.any_bad(block, rule)) == want, (v, rule)
            assert (vc.find_bad([(block, rule)]) == [0]) == want, (v, rule)
            scalar = torch.tensor(v, dtype=dtype, device=device)
            assert (vc.find_bad([(scalar, rule)]) == [0]) == want, (v, rule)


def test_describe_bad_names_the_first_bad_value_and_its_index():
    t = torch.full((16, 56), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    t.view(torch.uint8)[3, 5] = 0x7F
    t.view(torch.uint8)[9, 1] = 0xFF
    assert vc.describe_bad(t, E4M3_BYTES) == "byte 0x7f (NaN in e4m3) at [3, 5] (2 such values)"
    f = torch.ones(16, 56)
    f[2, 7] = -1.0
    assert vc.describe_bad(f, NONNEGATIVE) == "value -1.0 at [2, 7]"


@pytest.mark.parametrize("forced", [False, True], ids=["own-path", "device-path"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_request_is_read_back_once_per_device(device, forced, monkeypatch):
    """Many tensors, one read-back: on CUDA the one device synchronisation of the request; on the CPU no transfer
    (forced: CPU tensors take the device path, `PER_TENSOR_DEVICES` emptied, as tests of whole updates do: one read)."""
    if forced:
        monkeypatch.setattr(vc, "PER_TENSOR_DEVICES", set())
    items = [(torch.rand(8, 9, device=device) + 0.1, POSITIVE) for _ in range(50)]
    items += [(torch.full((64, 32), 0x40, dtype=torch.uint8, device=device), UE8M0_BYTES) for _ in range(50)]
    items += [(torch.rand((), device=device) + 0.1, POSITIVE) for _ in range(50)]
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            reads.append(f"{self.device.type}:{_name}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    assert vc.find_bad(items) == []
    transfers = [r for r in reads if not r.startswith("cpu:")]
    assert transfers == ([] if device == "cpu" else ["cuda:tolist"]), reads
    if forced or device != "cpu":
        assert reads == [f"{device}:tolist"], reads
    items[37][0][3, 3] = math.nan
    items[80][0][0, 0] = 0xFF
    items[120][0].fill_(-1.0)
    assert vc.find_bad(items) == [37, 80, 120]  # a refusal may read more: which tensor, which value
