"""A DeepSeek-V3 (FP8 block) with its NextN / MTP draft through a real `sglang.Engine` on a GPU, CUDA graphs on,
EAGLE speculative decoding, the plugin's path (emulated kernels on a faked SM100): does an RL update reach the draft?

    python -m tests.gpu.draft_engine_run            # prints the JSON report tests/gpu/test_engine_graphs.py asserts

A stale draft changes no token (the target verifies every draft token) — only how many drafts are accepted, which
is how RL users meet it (vllm-ascend#13209: MTP acceptance fell to 0 % with the draft left unsynced). So the checks
compare the speculative counters of each request (`spec_verify_ct`, the accepted drafts), not just tokens:
* engine G on checkpoint A (target and draft), graphs on: tokens and counters; `update_weights_from_disk(C)`, B
  with one expert of the draft's MoE layer malformed: refused, G's tokens and counters still A's (SGLang loads the
  target, then the draft, and stops at the draft's refusal: without the plugin's whole-request check the target would
  already serve B; B's tokens differ from A's, so the check can see that); then `update_weights_from_disk(B)`;
* engine F, a fresh load of B (target and draft from B): G's tokens and counters after its update must equal F's;
* engine S, the control: target B with the draft of A (what a stale draft serves): its counters must differ from
  F's, else the comparison above could not see a stale draft at all.
The checkpoint is tests/support/draft_worker.py's `write_nextn` (the sandbox's tiny DeepSeek-V3, its last layer the
NextN layer with routed experts), at the GPU's MLA width (engine_run.SPEC) and a hidden size of 512.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

from .engine_run import PROMPTS, SPEC, Engine, _engine_args

#: EAGLE with one draft step, as tests/support/draft_worker.py SPEC_ARGS; CUDA graphs for the draft too
SPEC_ARGS = dict(
    speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2
)
NEW_TOKENS = 16
#: the import stub's module: SGLang 0.5.17's EAGLE draft-extend graph capture (`eagle_worker_v2._capture_cuda_graphs`)
#: imports `layers/attention/dsa_backend.py` for an isinstance check, which imports `deep_gemm` at module level on
#: CUDA; sgl-deep-gemm is not carried (not reachable from here: ci/gpu-wheels) and a DeepSeek-V3 on triton MLA never
#: calls it (dsa_backend uses it inside DSA-only functions). Every use raises; SGLANG_ENABLE_JIT_DEEPGEMM=0 keeps
#: SGLang's own DeepGEMM switch off (`deep_gemm_wrapper/configurer.py` would otherwise read an importable module as
#: "DeepGEMM present"). docs/TESTING.md lists it with the stand-ins.
DEEP_GEMM_STUB = '''"""Import stub (tests/gpu/draft_engine_run.py): sgl-deep-gemm is not installed here."""


def __getattr__(name):
    raise NotImplementedError(f"deep_gemm.{name}: an import stub on this GPU test machine (sgl-deep-gemm not carried)")
'''


def deep_gemm_import_stub(work: str) -> bool:
    """Put the stub (DEEP_GEMM_STUB) on this process's and its children's path where no deep_gemm is importable."""
    import importlib.util

    if importlib.util.find_spec("deep_gemm") is not None:
        return False
    root = os.path.join(work, "stubs")
    os.makedirs(os.path.join(root, "deep_gemm"), exist_ok=True)
    with open(os.path.join(root, "deep_gemm", "__init__.py"), "w") as f:
        f.write(DEEP_GEMM_STUB)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "0"
    return True


COUNTERS = ("spec_verify_ct", "spec_accepted_drafts", "spec_num_correct_drafts", "spec_accept_length")


def sign_heads(path: str) -> str:
    """Make the draft's guesses count: with random weights a draft never proposes the target's next token (0 accepted
    drafts, whichever draft weights are served — a check that cannot fail). Here the final norms of the target and
    of the draft (`model.norm`, the NextN layer's `shared_head.norm`) keep one hidden coordinate only, so each picks
    one of two tokens by that coordinate's sign (the head is shared): the draft is right about half of the time, and
    which times depends on every weight of its MoE layer."""
    import glob

    import torch
    from safetensors.torch import load_file, save_file

    (f,) = glob.glob(os.path.join(path, "*.safetensors"))
    t = load_file(f)
    for name in [n for n in t if n == "model.norm.weight" or n.endswith(".shared_head.norm.weight")]:
        w = torch.zeros_like(t[name])
        w[0] = 8.0
        t[name] = w
    save_file(t, f, metadata={"format": "pt"})
    return path


def bad_draft_copy(src: str, dst: str, layer: int) -> str:
    """`src` with the NextN layer's (`layer`) expert 3 gate weight one column too wide: a tensor only the draft
    reads."""
    import glob
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (f,) = glob.glob(os.path.join(dst, "*.safetensors"))
    t = load_file(f)
    name = f"model.layers.{layer}.mlp.experts.3.gate_proj.weight"
    raw = t[name].view(torch.uint8)
    t[name] = torch.cat([raw, raw[:, :1]], 1).view(t[name].dtype)
    save_file(t, f, metadata={"format": "pt"})
    return dst


def generate(e: Engine) -> tuple[list, list]:
    out = e.engine.generate(
        input_ids=[list(p) for p in PROMPTS], sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS}
    )
    tokens = [list(o["output_ids"]) for o in out]
    counters = [{k: o["meta_info"].get(k) for k in COUNTERS if k in o["meta_info"]} for o in out]
    return tokens, counters


def run(workdir: str | None = None) -> dict:
    from sglang_trtllm_moe.sandbox import checkpoints as ck

    from ..support.draft_worker import write_nextn

    os.environ["SGLANG_TRTLLM_MOE_EMULATE"] = "1"
    os.environ["SGLANG_TRTLLM_MOE_TEST_FAKE_SM"] = "100"
    work = workdir or tempfile.mkdtemp(prefix="gpu-draft-")
    # hidden 512: the draft-extend graph's fused_eh_norm takes a hidden size in (256, 8192], a multiple of 256
    spec = ck.TinySpec(
        "deepseek_v3", "fp8_block", seed=0, layers=("dense", "moe", "moe"), hidden=512, **SPEC["deepseek_v3"]
    )
    a = sign_heads(write_nextn(os.path.join(work, "A"), spec))
    b = sign_heads(write_nextn(os.path.join(work, "B"), spec.with_seed(1)))
    c = bad_draft_copy(b, os.path.join(work, "C"), len(spec.layers) - 1)
    rep: dict = {"deep_gemm_import_stub": deep_gemm_import_stub(work)}
    rep["release"] = __import__("sglang").__version__
    t0 = time.perf_counter()

    def step(name: str, ok: bool, **detail) -> None:
        rep[name] = {"ok": bool(ok), **detail, "t": round(time.perf_counter() - t0, 1)}

    def engine(target: str, draft: str, name: str) -> Engine:
        return Engine(
            target,
            os.path.join(work, name),
            **_engine_args(False, graphs=True, arch="deepseek_v3", speculative_draft_model_path=draft, **SPEC_ARGS),
        )

    g = engine(a, a, "G")
    try:
        t_a, c_a = generate(g)
        step("engine G up (EAGLE, graphs)", bool(c_a and c_a[0]), tokens=t_a, counters=c_a)
        ok_c, msg_c = g.update_from_disk(c)
        t_gc, c_gc = generate(g)
        ok, msg = g.update_from_disk(b)
        t_gb, c_gb = generate(g)
        step("disk A->B", ok, message=str(msg)[:200])
    finally:
        g.shutdown()
    f = engine(b, b, "F")
    try:
        t_fb, c_fb = generate(f)
    finally:
        f.shutdown()
    s = engine(b, a, "S")
    try:
        t_sb, c_sb = generate(s)
    finally:
        s.shutdown()
    step(
        "a bad draft expert on disk: refused, target and draft unchanged",
        not ok_c and "refused" in str(msg_c) and t_gc == t_a and c_gc == c_a and t_fb != t_a,
        returned=[ok_c, str(msg_c)[:300]],
        same_tokens=t_gc == t_a,
        same_counters=c_gc == c_a,
        b_differs_from_a=t_fb != t_a,
    )
    step("tokens after the update == a fresh load of B", t_gb == t_fb, updated=t_gb, fresh=t_fb)
    step("draft counters after the update == a fresh load of B", c_gb == c_fb, updated=c_gb, fresh=c_fb)
    step(
        "control: a stale draft (target B, draft A) changes the counters",
        c_sb != c_fb and t_sb == t_fb,
        stale=c_sb,
        same_tokens=t_sb == t_fb,
    )
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    return rep


def main(argv=None) -> int:
    try:
        rep = run()
    except Exception as e:  # noqa: BLE001 - reported
        rep = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print(json.dumps(rep, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
