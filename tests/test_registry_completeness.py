"""Every registered weight format has every entry a format needs: the registry completeness check (issue #30).

A format is one module of formats/ and one unit of change (issue #37): what the plugin and its tests read of it is
declared there (its `example`, `tiny` checkpoint, `upstream_verdicts`, ...) or derived from the registry, so adding
one touches its module, `FORMATS`, what its family hook must tell apart, and its tests. For every format in
`formats.FORMATS` this checks each entry (a new format fails here, naming what is missing, before a checklist is
followed or forgotten); docs/ARCHITECTURE.md's "add a weight format" follows this list:

 1. the registry: a unique name and a title, `quantizations` per runner backend (the TRT-LLM-Gen backends, or its
    `own_backend`), activations the kernels name (kernel_api.GATED / NON_GATED), an intermediate alignment that is a
    multiple of the kernel's own tiling;
 2. its kernel family in `kernel_api.FAMILIES`, and both entry points of that family in the emulator;
 3. a load rule for every laid-out parameter and every scalar (validation.py's kind, value rule, byte code);
 4. detection: a checkpoint config, as SGLang names its quantization (selection/hf_config.py), that selection holds
    in this format and serves on one of its backends (the tiny checkpoint's, else the format's `example`);
 5. its built-in hook module (`hook_module`, registered by plugin.builtin_modules()) takes such layers over
    (`_prepare.take_over`);
 6. a defer verdict on every tested release: the format's own `upstream_verdicts` (compat/defer.py's `Verdict`),
    declared by its own class, never two on one release;
 7. a layer kind in the CPU harness: the format's `example` (formats/records.py), from which sandbox/layers.py's
    LAYERS and tests/test_registry_consistency.py's KINDS derive;
 8. a layer test file (tests/test_<name>_layer.py, else its module's tests/test_<module>_layer.py, else LAYER_TESTS),
    selected by a capability column of the compat matrix (tests/support/matrix.py CAPABILITIES);
 9. docs/RELIABILITY.md's table of write kinds names each of its parameters;
10. a tiny checkpoint for the whole-model tests: the format's own `tiny` (formats/records.py `TinyCheckpoint`, from
    which sandbox/tiny_spec.py derives QUANTS / ONLINE / SUPPORTED; a new stored encoding adds its writers to
    sandbox/checkpoints.py and checkpoint_configs.py), or `NoTinyCheckpoint` saying why not.

Where a format has no entry on purpose, the exception is written with why: in the format (`NoTinyCheckpoint`) or below.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import re

import pytest

from sglang_trtllm_moe import emulator, formats, kernel_api, layouts
from sglang_trtllm_moe.compat import defer
from sglang_trtllm_moe.compat.releases import TESTED
from sglang_trtllm_moe.formats import BACKENDS, FORMATS
from sglang_trtllm_moe.formats.load_rules import BYTE_CODES, KINDS, VALUE_RULES
from sglang_trtllm_moe.plugin import builtin_modules
from sglang_trtllm_moe.sandbox.format_examples import NoTinyCheckpoint, TinyCheckpoint, example_of, tiny_of
from sglang_trtllm_moe.selection import problem_from_hf_config

from .support import format_examples
from .support.helpers import REPO

IDS = [f.name for f in FORMATS]

#: 7. formats without a flashinfer_trtllm layer in the consistency test: why
NO_TRTLLM_LAYER = {
    "mxfp4_gptoss": (
        "SGLang builds gpt-oss MXFP4 layers on its own flashinfer_mxfp4 backend only; tests/test_mxfp4_gptoss_layer.py "
        "builds them there and tests/test_mx_selection.py checks selection's refusal on flashinfer_trtllm"
    ),
}
#: 8. layer test files of formats that share one named after neither (default: tests/test_<name>_layer.py, else
#: the one of the format's module, tests/test_<module>_layer.py: a variant in its parent's module shares its test)
LAYER_TESTS = {
    "fp8_tensor": "tests/test_fp8_layer.py",
    "fp8_tensor_modelopt": "tests/test_fp8_layer.py",
    "fp8_block": "tests/test_fp8_layer.py",
}


def _tiny_formats() -> dict[str, str]:
    """Registry name -> the tiny-checkpoint quant whose config selection holds in that format."""
    from sglang_trtllm_moe.sandbox import checkpoint_configs, tiny_spec

    out = {}
    for quant in tiny_spec.QUANTS:
        spec = tiny_spec.TinySpec(quant=quant)  # an online quant: its checkpoint served with its --quantization
        problem = problem_from_hf_config(checkpoint_configs.config(spec), quantization=spec.quantization)
        assert problem is not None, quant
        fmt, why = problem.weight_format()
        assert fmt is not None, (quant, why)
        out.setdefault(fmt.name, quant)
    return out


def _hf_config(fmt) -> tuple[dict, str | None]:
    """(a checkpoint config holding `fmt`, the `--quantization` it is served with: None = its own config's)."""
    from sglang_trtllm_moe.sandbox import checkpoint_configs, tiny_spec

    if isinstance(tiny_of(fmt), TinyCheckpoint):
        spec = tiny_spec.TinySpec(quant=tiny_of(fmt).quant)  # an online quant: only its --quantization names it
        return checkpoint_configs.config(spec), spec.quantization
    return format_examples.hf_config(fmt), example_of(fmt).quantization  # the format's own example


def test_names_are_unique():
    assert len(set(IDS)) == len(IDS), IDS


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_1_registry_entry(fmt):
    assert fmt.name and fmt.title and formats.by_name(fmt.name) is fmt
    assert fmt.quantizations, f"{fmt.name}: serves no quantization on any backend"
    assert set(fmt.quantizations) <= {*BACKENDS, fmt.own_backend}, (fmt.name, set(fmt.quantizations))
    if fmt.own_backend is not None:
        assert fmt.own_backend not in BACKENDS and fmt.own_backend in fmt.quantizations, fmt.name
    assert fmt.gated_activations <= set(kernel_api.GATED), (fmt.name, fmt.gated_activations)
    assert fmt.non_gated_activations <= set(kernel_api.NON_GATED), (fmt.name, fmt.non_gated_activations)
    gated, plain = fmt.intermediate_align
    assert gated % layouts.GATED_ALIGN == 0 and plain % layouts.NON_GATED_ALIGN == 0, (fmt.name, fmt.intermediate_align)


def test_0_required_members_are_declared_by_role():
    """Each role says what a format MUST define; a registered format that leaves one unset is refused by name."""
    from sglang_trtllm_moe.formats import base, roles

    assert roles.required_members(base.WeightFormat) == (
        "name",
        "title",
        "quantizations",
        "encoding",
        "params",
        "hook_module",
        "upstream_verdicts",
    )
    assert base.WeightFormat.__abstractmethods__ == {"describes", "kernel_args"}
    for fmt in FORMATS:
        assert roles.missing(fmt) == (), fmt.name

    class NoKernelArgs(base.WeightFormat):
        def describes(self, checkpoint):
            return False

    with pytest.raises(TypeError, match="kernel_args"):
        NoKernelArgs()

    class Unnamed(type(formats.BF16)):
        title = roles.MUST
        encoding = roles.MUST

    with pytest.raises(TypeError, match=r"does not define: title, encoding$"):
        base.check_complete(Unnamed())


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_2_kernel_family_and_emulator(fmt):
    assert fmt.kernel in kernel_api.FAMILIES, f"{fmt.name}: kernel {fmt.kernel!r} is not in kernel_api.FAMILIES"
    for routed in (False, True):
        entry = kernel_api.kernel_function(fmt.kernel, routed)
        assert callable(getattr(emulator, entry, None)), f"{fmt.name}: the emulator has no {entry}"
    assert type(fmt).kernel_args is not formats.WeightFormat.kernel_args, f"{fmt.name}: no kernel_args"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_3_load_rule_for_every_parameter_and_scalar(fmt):
    assert fmt.params, f"{fmt.name}: lays out no parameter"
    assert set(fmt.scalar_rules) <= set(fmt.scalar_params), (fmt.name, set(fmt.scalar_rules))
    codes = set(BYTE_CODES.values()) | {formats.load_rules.E4M3_BYTES, formats.load_rules.UE8M0_BYTES}
    for name in (*(p.name for p in fmt.params), *fmt.scalar_params):
        rule = fmt.load_rule(name)
        assert rule is not None, f"{fmt.name}: no load rule for {name}"
        assert rule.kind in KINDS and rule.group in fmt.groups(), (fmt.name, rule)
        assert rule.values in (*VALUE_RULES, None) and rule.byte_code in (*codes, None), (fmt.name, rule)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_4_detected_from_its_checkpoint_config(fmt):
    config, quantization = _hf_config(fmt)
    problem = problem_from_hf_config(config, quantization=quantization)
    assert problem is not None, fmt.name
    found, why = problem.weight_format()
    assert found is fmt, f"{fmt.name}: its checkpoint config is held as {found} ({why})"
    assert any(fmt.serves(b, problem.checkpoint) for b in fmt.quantizations), (fmt.name, problem.checkpoint)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_5_a_builtin_hook_takes_such_layers_over(fmt):
    assert fmt.hook_module in builtin_modules(), fmt.name
    mod = importlib.import_module(fmt.hook_module)
    assert "take_over(" in inspect.getsource(mod) and any(v is fmt for v in vars(mod).values()), (
        f"{fmt.name}: its hook module {fmt.hook_module} does not take its layers over (_prepare.take_over)"
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_6_defer_verdict_on_every_tested_release(fmt):
    """The format's own verdicts (`upstream_verdicts`): one on every tested release, never two (the registry refuses
    overlapping ones at import), declared by its own class — a variant inheriting its parent's would claim a
    measurement nobody made of it."""
    missing = [r for r in TESTED if defer.verdict(fmt, r) is None]
    assert not missing, f"{fmt.name}: its upstream_verdicts have no verdict on {missing}"
    assert defer.overlap(fmt) is None, fmt.name
    assert "upstream_verdicts" in vars(type(fmt)) or "upstream_verdicts" in vars(fmt), (
        f"{fmt.name}: upstream_verdicts inherited from {type(fmt).__mro__[1].__name__}; declare its own"
    )


def test_6_overlapping_verdicts_are_refused():
    from sglang_trtllm_moe.formats import base

    class Twice(type(formats.BF16)):
        upstream_verdicts = (
            defer.Verdict(defer.CPU_ORACLE.releases, False, "read: a"),
            defer.Verdict(defer.EVERY_RELEASE.releases, False, "read: b"),
        )

    with pytest.raises(TypeError, match=r"bf16: two of its upstream_verdicts hold on SGLang 0\.5\.16$"):
        base.check_complete(Twice())


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_7_a_layer_kind_in_the_harness(fmt):
    from sglang_trtllm_moe.sandbox import layers

    from .test_registry_consistency import KINDS as HARNESS_KINDS

    kind = example_of(fmt).kind
    assert layers.LAYERS[kind].format is fmt, kind
    if fmt.name in NO_TRTLLM_LAYER:
        assert kind not in HARNESS_KINDS, f"{fmt.name} has a kind now: drop its exception"
        return
    assert kind in HARNESS_KINDS, f"{fmt.name}: no layer kind {kind!r} in tests/test_registry_consistency.py KINDS"
    checkpoint, make = HARNESS_KINDS[kind]
    found, why = formats.for_checkpoint(checkpoint)
    assert found is fmt and callable(make), (fmt.name, kind, found, why)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_8_a_layer_test_in_a_matrix_column(fmt):
    from tests.support.matrix import CAPABILITIES

    module = type(fmt).__module__.rsplit(".", 1)[-1]
    path = LAYER_TESTS.get(fmt.name, f"tests/test_{fmt.name}_layer.py")
    if fmt.name not in LAYER_TESTS and not (REPO / path).is_file():
        path = f"tests/test_{module}_layer.py"
    assert (REPO / path).is_file(), f"{fmt.name}: no layer test {path}"
    columns = [key for key, _title, selectors in CAPABILITIES if any(sel == path for sel, _ in selectors)]
    assert columns, f"{fmt.name}: no column of tests/support/matrix.py CAPABILITIES runs {path}"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_9_reliability_table_names_every_parameter(fmt):
    rows = {}
    for line in (REPO / "docs" / "RELIABILITY.md").read_text().splitlines():
        m = re.match(r"\| (" + "|".join(KINDS) + r") \| (.*?) \|", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    assert set(rows) == set(KINDS), sorted(rows)
    for name in (*(p.name for p in fmt.params), *fmt.scalar_params):
        kind = fmt.load_rule(name).kind
        assert any(fnmatch.fnmatch(name, pat) for pat in rows[kind]), (
            f"{fmt.name}: docs/RELIABILITY.md's {kind} row names no pattern of {name} ({rows[kind]})"
        )


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_10_a_tiny_checkpoint(fmt):
    """The sandbox's tiny checkpoint of the format (format_examples.TINY) names its quant (which sandbox/tiny_spec.py
    derives) and the checkpoint of that quant is held in this format; or it says why it has none, and no tiny
    checkpoint holds it."""
    from sglang_trtllm_moe.sandbox import tiny_spec

    tiny = _tiny_formats()
    if isinstance(tiny_of(fmt), NoTinyCheckpoint):
        assert tiny_of(fmt).why, fmt.name
        assert fmt.name not in tiny, f"{fmt.name} has a tiny checkpoint ({tiny[fmt.name]}) now: declare it"
        return
    own = tiny_of(fmt)
    assert isinstance(own, TinyCheckpoint), (fmt.name, own)
    assert own.quant in tiny_spec.QUANTS, (fmt.name, tiny_spec.QUANTS)
    assert tiny.get(fmt.name) == own.quant, f"{fmt.name}: the tiny {own.quant} checkpoint is not held in it"
    for arch in own.archs:
        assert own.quant in tiny_spec.SUPPORTED[arch], (fmt.name, arch)
    if tiny_of(fmt).stored is not None:
        spec = tiny_spec.TinySpec(quant=tiny_of(fmt).quant)
        assert spec.stored == tiny_of(fmt).stored and spec.server_args() == {"quantization": spec.quantization}, spec
        assert spec.quantization in {q for qs in fmt.quantizations.values() for q in qs}, (fmt.name, spec)


def test_exceptions_name_registered_formats():
    for table in (NO_TRTLLM_LAYER, LAYER_TESTS):
        assert set(table) <= set(IDS), set(table) - set(IDS)
