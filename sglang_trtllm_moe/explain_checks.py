"""What `explain` checks in what it is given, and what it knows will fail after SGLang has accepted it.

- The options it mirrors from SGLang (`--moe-runner-backend`, `--moe-a2a-backend` as `--a2a`, `--quantization`) are
  checked against the choices of the installed SGLang's own argument parser (`ServerArgs.add_cli_args`), not a copy:
  a value SGLang's launcher would refuse is refused here, with SGLang's list. `--sm` must read as a CUDA compute
  capability (major x 10 + minor). A model directory without a readable `config.json` is one line, not a traceback.
- `first_forward` says when the winner is accepted by SGLang and then fails at the first forward (SGLang's warm-up):
  the TRT-LLM runners off SM 10.x (no SGLang check of the SM; the plugin's runner raises KernelUnavailableError), and
  `flashinfer_mxfp4` on a ModelOpt NVFP4 model from SGLang 0.5.16 (ModelOptNvFp4FusedMoEMethod builds the runner,
  then its `apply` has no branch for it: NotImplementedError; before, it falls back to cutlass_moe_fp4).
"""

from __future__ import annotations

import difflib
import functools
import json
import os


class ExplainInputError(ValueError):
    """An `explain` argument SGLang would refuse, or a model directory it cannot read: one line per problem."""


#: explain's option -> the SGLang flag it mirrors (whose choices the installed SGLang's parser holds)
MIRRORED = {
    "--moe-runner-backend": "--moe-runner-backend",
    "--a2a": "--moe-a2a-backend",
    "--quantization": "--quantization",
}

#: SGLang quantizations whose MoE layers get ModelOptNvFp4FusedMoEMethod (nvfp4_online's method subclasses it and
#: keeps its `apply`): from 0.5.16 that `apply` raises NotImplementedError for flashinfer_mxfp4 at the first
#: forward, after `create_moe_runner` built the runner without complaint (features.
#: NVFP4_APPLY_REFUSES_UNSERVED_BACKEND; 0.5.23 layers/quantization/modelopt_quant.py 3111-3150, 3184-3368)
MODELOPT_NVFP4_QUANTS = ("modelopt_fp4", "nvfp4_online")


@functools.lru_cache(maxsize=1)
def sglang_choices() -> tuple[str | None, dict[str, tuple[str, ...]]] | None:
    """(SGLang's version, {flag: choices}) for the flags `explain` mirrors, read from the installed SGLang's own
    argument parser; None when SGLang cannot be imported here."""
    import argparse

    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # noqa: BLE001 - no SGLang (or one that does not import here): nothing to check against
        return None
    from .compat.releases import installed_version

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    wanted = set(MIRRORED.values())
    choices = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor for an option's choices
        for flag in set(action.option_strings) & wanted:
            if action.choices:
                choices[flag] = tuple(str(c) for c in action.choices)
    version = installed_version()
    return (str(version) if version is not None else None), choices


def _refused(option: str, value: str, release: str | None, choices: tuple[str, ...]) -> str:
    flag = MIRRORED[option]
    alias = f" (as {flag})" if flag != option else ""
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (
        f"{option} {value}{alias}: SGLang {release or '(installed)'} refuses it; its choices: "
        f"{', '.join(choices)}{hint}"
    )


def argument_problems(
    *, moe_runner_backend: str, a2a_backend: str, quantization: str | None, sm: int | None
) -> list[str]:
    """One line per argument SGLang (or CUDA) would refuse; [] when all are accepted or SGLang is not installed
    (then only `--sm` is checked)."""
    problems = []
    if sm is not None and not (70 <= sm <= 129):
        problems.append(
            f"--sm {sm}: not a CUDA compute capability written as major x 10 + minor (90: H100 / H200, "
            "100: B200 / GB200, 103: B300, 120: RTX PRO 6000 / RTX 50xx)"
        )
    known = sglang_choices()
    if known is None:
        return problems
    release, choices = known
    given = {"--moe-runner-backend": moe_runner_backend, "--a2a": a2a_backend, "--quantization": quantization}
    for option, value in given.items():
        allowed = choices.get(MIRRORED[option])
        if value is not None and allowed and value not in allowed:
            problems.append(_refused(option, value, release, allowed))
    return problems


def read_config(model_path: str) -> dict:
    """The model directory's config.json; an ExplainInputError in one line when it is not there or not JSON."""
    if not os.path.isdir(model_path):
        raise ExplainInputError(f"--model {model_path}: no such directory (explain reads its config.json only)")
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ExplainInputError(f"--model {model_path}: no config.json in it (a HuggingFace model directory)") from None
    except (OSError, ValueError) as e:
        raise ExplainInputError(f"--model {model_path}: config.json cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ExplainInputError(f"--model {model_path}: config.json is not a JSON object")
    return config


def first_forward(winner: str, problem, device) -> dict | None:
    """When the winner is one SGLang accepts and then fails at the first forward (warm-up): {error, reason};
    None when nothing here says it will fail."""
    from . import env
    from .compat import features
    from .formats import TRTLLM, TRTLLM_ROUTED

    if winner in (TRTLLM, TRTLLM_ROUTED) and device.sm is not None and device.sm // 10 != 10 and not env.emulating():
        return {
            "error": "KernelUnavailableError",
            "reason": f"{winner} on SM{device.sm}: SGLang accepts the flag on any GPU, but the TRT-LLM-Gen kernels "
            "need SM 10.x (B200 / GB200 / B300): the first forward (SGLang's warm-up) stops with "
            f"KernelUnavailableError; on SM{device.sm} leave --moe-runner-backend on auto (SGLang picks one for "
            "that GPU)",
        }
    if (
        winner == "flashinfer_mxfp4"
        and problem is not None
        and problem.quantization in MODELOPT_NVFP4_QUANTS
        and features.NVFP4_APPLY_REFUSES_UNSERVED_BACKEND.present()
    ):
        return {
            "error": "NotImplementedError",
            "reason": f"flashinfer_mxfp4 on a {problem.quantization} (NVFP4) model: SGLang accepts it and builds the "
            "layers, then ModelOptNvFp4FusedMoEMethod.apply raises NotImplementedError('Unsupported "
            "moe_runner_backend for NVFP4 MoE') at the first forward (SGLang's warm-up); flashinfer_mxfp4 is for "
            "MXFP4 experts: use auto or flashinfer_trtllm for NVFP4",
        }
    return None


__all__ = ["ExplainInputError", "argument_problems", "first_forward", "read_config", "sglang_choices"]
