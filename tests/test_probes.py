"""The shared fresh processes of tests/support/probes.py: each section's result reaches its own tests only, a section
that raises fails its own tests (with its traceback) and no other, sections run in their order in one process of
their environment, and a process that dies fails every test that asks it."""

from __future__ import annotations

import pytest

from .support import probes


@pytest.fixture
def env(monkeypatch):
    name = "probes-self-test"
    monkeypatch.setitem(probes.ENVS, name, lambda: {"PROBE_SELF_TEST": "from ENVS"})
    monkeypatch.setitem(probes._SECTIONS, name, {})
    yield name
    probes._RUNS.pop(name, None)


def test_sections_run_in_order_in_one_process_and_a_raising_one_fails_only_its_own(env):
    probes.section(env, "late", "import os, sys\nRESULT = [os.getpid(), os.environ['FROM_PREPARE'], sys.order]", 90)
    probes.section(env, "boom", "import sys\nsys.order.append('boom')\nraise ValueError('only mine')")
    probes.section(
        env,
        "first",
        "import os, sys\nsys.order = ['first']\n"
        "RESULT = [os.getpid(), os.environ['PROBE_SELF_TEST'], 'sglang' in sys.modules]",
        order=probes.FIRST,
        prepare=lambda: {"FROM_PREPARE": "from prepare"},
    )
    first, late = probes.result(env, "first"), probes.result(env, "late")
    assert first[1:] == ["from ENVS", False]
    assert late[1:] == ["from prepare", ["first", "boom"]]  # in order, after the one that raised
    assert first[0] == late[0]  # one process
    with pytest.raises(AssertionError, match="only mine"):
        probes.result(env, "boom")
    first[1] = "changed"
    assert probes.result(env, "first")[1] == "from ENVS"  # each caller gets its own copy
    with pytest.raises(AssertionError, match="registered after"):
        probes.section(env, "too late", "RESULT = 1")


def test_a_process_that_dies_fails_every_section(env):
    probes.section(env, "ok", "RESULT = 1")
    probes.section(env, "exit", "import os\nos._exit(3)")
    for name in ("ok", "exit"):
        with pytest.raises(AssertionError, match="exit 3"):
            probes.result(env, name)
