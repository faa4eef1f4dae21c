"""`explain` on a machine without a GPU (issue #28, finding 6): asked about this machine (no `--sm`), it says there
is no CUDA GPU here and how to ask about a Blackwell server, instead of "no CUDA GPU is not SM 10.x"."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_trtllm_moe.sandbox import checkpoints as ck

from .support.helpers import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks about a machine without a CUDA GPU; this one has one")
def test_explain_without_sm_on_a_machine_without_a_gpu(tmp_path):
    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="qwen3_moe", quant="nvfp4"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", "explain", "--model", model, "--no-sglang"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "[NOT_SM100]" in out and "no CUDA GPU on this machine (the TRT-LLM-Gen kernels need SM 10.x)" in out, out
    assert "is not SM 10.x" not in out.replace("need SM 10.x", ""), out
    assert "note: this machine has no CUDA GPU" in out and "pass --sm 100" in out, out


def test_explain_says_which_update_entry_points_leave_a_speculative_draft_stale(tmp_path):
    """`--speculative-algorithm`: before 0.5.21 the distributed update reaches the target only (features.
    DISTRIBUTED_UPDATE_SKIPS_DRAFT, probed against the release's scheduler); from 0.5.21 no entry point leaves the
    draft out unless the request's selector does."""
    from sglang_trtllm_moe.compat import features
    from sglang_trtllm_moe.explain import explain_model

    model = ck.write(str(tmp_path / "tiny"), ck.TinySpec(arch="deepseek_v3", quant="fp8_block"))
    rep = explain_model(model, sm=100, run_sglang=False, speculative_algorithm="EAGLE")["draft_updates"]
    stale = features.DISTRIBUTED_UPDATE_SKIPS_DRAFT.present()
    assert rep["stale_after"] == (["update_weights_from_distributed"] if stale else []), rep
    assert ("keeps serving its old weights" in rep["reason"]) == stale, rep


# ---- explain checks what it is given (issue #54) ---------------------------------------------------------------------


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "sglang_trtllm_moe", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        env=env,
        check=False,
    )


def _sglang_parser_choices() -> dict[str, list[str]]:
    """The oracle: the choices of the installed SGLang's own launcher parser (what `python -m sglang.launch_server`
    accepts)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    flags = ("--moe-runner-backend", "--moe-a2a-backend", "--quantization")
    return {f: [str(c) for c in a.choices] for a in parser._actions for f in a.option_strings if f in flags}


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory):
    return ck.write(str(tmp_path_factory.mktemp("explain") / "tiny"), ck.TinySpec(arch="qwen3_moe", quant="nvfp4"))


def test_explain_refuses_what_sglang_would_refuse_with_sglangs_own_list(tiny_nvfp4):
    """A misspelt backend, A2A backend or quantization is refused with the installed SGLang's own choices (and the
    closest one), an SM that is no compute capability too; one line each on stderr, exit 2, no traceback."""
    pytest.importorskip("sglang.srt.server_args", reason="explain reads the choices of the installed SGLang")
    choices = _sglang_parser_choices()
    proc = _cli(
        "explain", "--model", tiny_nvfp4, "--sm", "10", "--moe-runner-backend", "flashinfer_trtlm",
        "--a2a", "deepepp", "--quantization", "compressed_tensors", "--no-sglang",
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # (older releases print import warnings of their own on stderr first)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sglang-trtllm-moe explain: ")]
    assert len(lines) == 4 and proc.stdout == "", (proc.stdout, proc.stderr[-3000:])
    sm, backend, a2a, quant = lines
    assert "--sm 10: not a CUDA compute capability" in sm, sm
    for line, flag, closest in (
        (backend, "--moe-runner-backend", "flashinfer_trtllm"),
        (a2a, "--moe-a2a-backend", "deepep"),
        (quant, "--quantization", "compressed-tensors"),
    ):
        assert f"its choices: {', '.join(choices[flag])}; did you mean {closest}?" in line, (line, choices[flag])
    # what SGLang accepts passes (the values of the lines above, spelt right)
    ok = _cli(
        "explain", "--model", tiny_nvfp4, "--sm", "100", "--moe-runner-backend", "flashinfer_trtllm",
        "--a2a", "deepep", "--quantization", "modelopt_fp4", "--no-sglang",
    )  # fmt: skip
    assert ok.returncode == 0 and "sglang-trtllm-moe explain:" not in ok.stderr, ok.stderr[-3000:]
    assert "flashinfer_trtllm" in ok.stdout and "[EXPLICIT]" in ok.stdout, ok.stdout


def test_explain_answers_a_model_directory_it_cannot_read_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    for model, says in (
        (tmp_path / "nowhere", "no such directory"),
        (tmp_path / "empty", "no config.json in it"),
        (tmp_path / "bad", "config.json cannot be read"),
    ):
        proc = _cli("explain", "--model", str(model), "--sm", "100")
        assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
        assert proc.stderr == f"sglang-trtllm-moe explain: --model {model}: {proc.stderr.split(': ', 2)[2]}"
        assert says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize(
    "sm, backend, fails",
    [
        (90, "flashinfer_trtllm", "KernelUnavailableError"),
        (90, "flashinfer_trtllm_routed", "KernelUnavailableError"),
        (100, "flashinfer_trtllm", None),
        (100, "flashinfer_mxfp4", "NotImplementedError"),  # from 0.5.16: features.NVFP4_APPLY_REFUSES_UNSERVED_BACKEND
        (90, "auto", None),
        (90, "flashinfer_trtllm+emulated", None),  # SGLANG_TRTLLM_MOE_EMULATE=1: the emulator runs on any device
    ],
)
def test_explain_says_when_the_winner_fails_at_the_first_forward(tiny_nvfp4, monkeypatch, sm, backend, fails):
    """An explicit TRT-LLM runner off SM 10.x (SGLang has no SM check for it; the kernels need SM 10.x), and
    flashinfer_mxfp4 on a ModelOpt NVFP4 model (SGLang builds it, then its apply refuses: the flag's probe in
    tests/test_compat_features.py reads it from the installed release)."""
    from sglang_trtllm_moe.compat import features
    from sglang_trtllm_moe.explain import explain_model

    if backend == "flashinfer_mxfp4" and not features.NVFP4_APPLY_REFUSES_UNSERVED_BACKEND.present():
        fails = None  # before 0.5.16 SGLang's apply falls back to cutlass_moe_fp4
    backend, emulated = backend.split("+")[0], backend.endswith("+emulated")
    if emulated:
        monkeypatch.setenv("SGLANG_TRTLLM_MOE_EMULATE", "1")
    else:
        monkeypatch.delenv("SGLANG_TRTLLM_MOE_EMULATE", raising=False)
    r = explain_model(tiny_nvfp4, sm=sm, moe_runner_backend=backend, run_sglang=False)
    assert (r["first_forward"] or {}).get("error") == fails, r["first_forward"]
    if fails:
        assert backend in r["first_forward"]["reason"] and "first forward" in r["first_forward"]["reason"]


def test_argument_problems_read_the_installed_releases_own_choices():
    """In process (cheap enough for every release of the matrix): every choice SGLang's own parser offers passes,
    a value it does not offer is refused with that list."""
    pytest.importorskip("sglang.srt.server_args", reason="explain reads the choices of the installed SGLang")
    from sglang_trtllm_moe.explain_checks import argument_problems, sglang_choices

    choices = _sglang_parser_choices()
    assert sglang_choices()[1] == {k: tuple(v) for k, v in choices.items()}
    for backend in choices["--moe-runner-backend"]:
        assert argument_problems(moe_runner_backend=backend, a2a_backend="none", quantization=None, sm=100) == []
    for a2a in choices["--moe-a2a-backend"]:
        assert argument_problems(moe_runner_backend="auto", a2a_backend=a2a, quantization=None, sm=90) == []
    for q in choices["--quantization"]:
        assert argument_problems(moe_runner_backend="auto", a2a_backend="none", quantization=q, sm=120) == []
    (line,) = argument_problems(moe_runner_backend="trtllm", a2a_backend="none", quantization=None, sm=None)
    assert line.startswith("--moe-runner-backend trtllm: SGLang "), line
    assert ", ".join(choices["--moe-runner-backend"]) in line, line
