"""The CPU stand-ins reach processes SGLang spawns only through the test-time distribution, never otherwise; the
tiny-checkpoint generator is deterministic per tensor (a partial checkpoint is a byte subset of the full one)."""

from __future__ import annotations

import json

import torch

from sglang_trtllm_moe.sandbox import checkpoints as ck
from sglang_trtllm_moe.sandbox import standins

from .support import probes
from .support.helpers import last_json, run_python

PROBE = """
    import json, sys, torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16)
        torch.mm(a, a, out_dtype=torch.float32)
        mm = True
    except Exception:
        mm = False
    print(json.dumps({"mm_dtype": mm, "vllm_stub": "vllm._custom_ops" in sys.modules}))
"""


#: PROBE in a normal installation: the session's shared plain process (tests/support/probes.py), right after SGLang's
#: load_plugins() there (only the sys.modules check of test_plugin.py runs before it), before any other section
WITHOUT = probes.section("plain", "standins_without", PROBE.replace("print(json.dumps(", "RESULT = (("), order=1)


def test_spawned_processes_get_the_standins_through_sglang_load_plugins(tmp_path):
    path = standins.spawn_path(str(tmp_path / "standins"))
    with_dist = last_json(run_python(PROBE, pythonpath=[path]))
    assert with_dist == {"mm_dtype": True, "vllm_stub": True}
    without = probes.result("plain", WITHOUT)  # a normal installation: SGLang loads the plugin, no stand-in
    assert without == {"mm_dtype": False, "vllm_stub": False}


def test_partial_checkpoint_is_a_byte_subset_of_the_full_one():
    for arch in ck.ARCHS:
        spec = ck.TinySpec(arch, ck.SUPPORTED[arch][0], seed=3)
        full = ck.checkpoint(spec)
        layer = spec.moe_layers[-1]
        part = ck.checkpoint(spec, layers=[layer], experts=[2, 6], dense=False)
        assert part and all(
            torch.equal(
                full[n].view(torch.uint8) if full[n].dtype.itemsize == 1 else full[n],
                t if t.dtype.itemsize != 1 else t.view(torch.uint8),
            )
            for n, t in part.items()
        )
        assert all(f".layers.{layer}." in n and (".experts.2." in n or ".experts.6." in n) for n in part)
        assert json.dumps(ck.config(spec))  # serializable config with its quant config
