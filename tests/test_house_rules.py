"""Rules of the house the code itself can be checked against (issue #30), read from the runtime package's source.

* One place per release fact: a release-range literal (">=0.5.16", "<0.5.21", ...) appears in the runtime package
  only inside `compat/` (named flags with range and why, the defer table, the resolution adapters; the sandbox's own
  in `sandbox/releases.py`). A hook target names its range through a flag (`releases=features.X.releases`) or leaves
  it empty (every release the plugin runs on: `compat.releases.OLDEST_SUPPORTED` is that fact).
  Prose in docstrings may name releases.
* Shared helpers have one public home: no module imports another module's underscore name (a private *module*, such
  as `layouts/_triton.py`, may be imported inside its package), nor reads one as an attribute.
* Another module's objects by their public names: no module reads (or writes) `obj._name` — or names it in a string
  to `getattr` / `setattr` / `hasattr` / `delattr` — where `_name` is a private attribute a class of this package
  defines (`self._name = ...` in its methods, a class attribute, dataclass field
  or `__slots__` entry starting with `_`), outside the module that defines that class; `self._name` / `cls._name`
  are the class's own. The owning class offers a public method or property instead. SGLang's and torch's private
  names (`layer._weight_loader_impl`, `mask._version`, `torch._foreach_copy_`) are not ours and stay allowed.
* No runtime patch of torch: nothing in the package assigns an attribute of `torch` (a hook that does changes the
  whole process, every thread, for as long as it is suspended).
* No module of the package over `MAX_LINES` lines (issue #38), the CPU sandbox's included: a module that grows past
  it is split along its concerns.
* `compat/` is the bottom layer (issue #38): its modules import nothing of the package outside `compat/` (at module
  level or inside a function), except the leaf modules of `COMPAT_MAY_IMPORT`, which themselves import nothing of
  the package. What sits above (formats, selection, the runner) hands compat what it needs, never the other way.
* The sandbox is fenced (issue #54): `sandbox/` is an extension of the plugin, registered through the plugin's own
  entry-point group as a third-party one is (setup.cfg). The runtime (every module outside `sandbox/`) neither
  imports it (at module level, inside a function, through `importlib`) nor names it in code: no string of the
  runtime other than a docstring says "sandbox" or names a function or class the sandbox defines (prose in
  docstrings and comments may point at it). And `compat/` holds release facts only: each of its modules is listed
  in `COMPAT_MODULES` with the facts it holds, and none reads the sandbox's switch (SGLANG_TRTLLM_MOE_TEST_FAKE_SM).

Each rule has an allowlist of files that wait for work in progress, each entry saying what it waits for; an entry
whose file no longer breaks the rule fails, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re

import pytest

from .support.helpers import REPO

PACKAGE = REPO / "sglang_trtllm_moe"
NAME = PACKAGE.name

#: a PEP 440 specifier clause on a version ("<0.5.19", ">= 0.5.21", "==0.5.23")
RELEASE_RANGE = re.compile(r"(?:[<>]=?|==|!=|~=)\s*\d+\.\d+")

#: files (relative to the package) whose release-range literals wait for other work: what for
#: (none: the CPU sandbox's ranges are sandbox/releases.py's, init_rank is tests/support/sglang_runtime.py's)
PENDING_RELEASE_LITERALS: dict[str, str] = {}

#: files whose underscore imports wait for other work: what for
#: (none: sandbox/layers.py is the one layer builder, no mx_layers.py takes its _random_experts)
PENDING_PRIVATE_IMPORTS: dict[str, str] = {}


#: the most lines a module of the package may have
MAX_LINES = 450
#: files over MAX_LINES that wait for their split: what for
PENDING_LONG_MODULES: dict[str, str] = {}

#: compat/'s modules and the release facts each holds: a new module there says what release difference it is for
COMPAT_MODULES = {
    "compat/__init__.py": "the release check's public names (check_release, ReleaseStatus)",
    "compat/releases.py": "the releases the plugin runs on, tested or not (OLDEST_SUPPORTED, the tested list)",
    "compat/features.py": "every release difference the product meets, a named flag with range and why",
    "compat/defer.py": "per format and release: whether SGLang's own update path keeps the bytes exact",
    "compat/platform.py": "how each release resolves its MoE runner backend (the resolution adapters)",
    "compat/fake_platform.py": "how each release asks which GPU this is (explain --sm N fakes that answer)",
    "compat/routed_experts.py": "how each release reports the experts a request routed to",
    "compat/update_runners.py": "which release runs which weight-update entry points",
}

#: the sandbox's own release facts (what only standing SGLang up on a CPU meets), named flags like compat/'s
SANDBOX_RELEASES = "sandbox/releases.py"

#: the sandbox's switch for a faked GPU: read by the sandbox only (compat/ holds release facts, not test switches)
SANDBOX_SWITCH = "SGLANG_TRTLLM_MOE_TEST_FAKE_SM"

#: modules outside compat/ that compat/ may import: leaves that import nothing of the package themselves
#: (test_compat_leaves_are_leaves holds them to that)
COMPAT_MAY_IMPORT = {
    f"{NAME}.layer_attrs": "the attribute names the plugin sets on SGLang's objects (platform's REQUESTED_ATTR)",
}


def _sources() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def release_literals(tree: ast.Module) -> list[tuple[int, str]]:
    docs = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docs
        and RELEASE_RANGE.search(node.value)
    ]


def _module_of(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([NAME, *parts])


def _resolve(rel: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in package file `rel` imports from."""
    if not node.level:
        return node.module or ""
    pkg = _module_of(rel).split(".")
    if not rel.endswith("__init__.py"):
        pkg = pkg[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
    """Underscore names of the package's own modules this file imports or reads as attributes."""
    out = []
    bound: dict[str, str] = {}  # local name -> one of our modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(rel, node)
            if not (mod == NAME or mod.startswith(NAME + ".")):
                continue
            for a in node.names:
                if _is_module(f"{mod}.{a.name}"):
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
                elif _private(a.name):
                    out.append((node.lineno, f"from {mod} import {a.name}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == NAME or a.name.startswith(NAME + "."):
                    if a.asname:  # import sglang_trtllm_moe.layouts as L
                        bound[a.asname] = a.name
                    else:  # import sglang_trtllm_moe.layouts: the name bound is the package
                        bound[NAME] = NAME
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        dotted = bound[value.id]
        for part in reversed(chain):
            if _private(part) and not _is_module(f"{dotted}.{part}"):
                out.append((node.lineno, f"{value.id}.{'.'.join(reversed(chain))}"))
                break
            if not _is_module(f"{dotted}.{part}"):
                break
            dotted = f"{dotted}.{part}"
    return sorted(set(out))


def package_imports(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
    """Every module of the package that file `rel` imports, anywhere in it (function-local imports included):
    `from X import name` counts as X.name where that is a module, else as X."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(rel, node)
            if not (mod == NAME or mod.startswith(NAME + ".")):
                continue
            for a in node.names:
                out.append((node.lineno, f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name == NAME or a.name.startswith(NAME + ".")]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (node.args[0].value == NAME or node.args[0].value.startswith(NAME + "."))
        ):
            out.append((node.lineno, node.args[0].value))
    return sorted(set(out))


def upward_imports(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
    """A compat/ module's imports of the package outside compat/ (the leaves of COMPAT_MAY_IMPORT aside)."""
    if not rel.startswith("compat/"):
        return []
    return [
        (line, mod)
        for line, mod in package_imports(rel, tree)
        if not (mod == f"{NAME}.compat" or mod.startswith(f"{NAME}.compat.")) and mod not in COMPAT_MAY_IMPORT
    ]


def sandbox_names() -> set[str]:
    """The functions and classes only the sandbox's modules define at their top level, by name — the distinctive
    ones (two underscores or more, e.g. `random_nvfp4_checkpoint`: `main`, `run` or `server_args` say nothing of
    where they live)."""

    def defined(paths) -> set[str]:
        return {
            node.name
            for path in paths
            for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.strip("_").count("_") >= 2
        }

    sandbox = set((PACKAGE / "sandbox").rglob("*.py"))
    return defined(sandbox) - defined(set(PACKAGE.rglob("*.py")) - sandbox)


def sandbox_uses(rel: str, tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """A runtime module's imports of the sandbox, and its strings (docstrings aside) that say "sandbox" or name a
    function or class of it."""
    if rel.startswith("sandbox/"):
        return []
    out = [(line, mod) for line, mod in package_imports(rel, tree) if mod.startswith(f"{NAME}.sandbox")]
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if "sandbox" in node.value.lower() or node.value in names:
                out.append((node.lineno, repr(node.value[:80])))
        elif isinstance(node, ast.Attribute) and node.attr == "sandbox":
            out.append((node.lineno, ast.unparse(node)))
    return sorted(set(out))


def private_attributes(sources: list[tuple[str, ast.Module]]) -> dict[str, set[str]]:
    """The private attribute names the package's classes define -> the files defining them."""
    out: dict[str, set[str]] = {}
    for rel, tree in sources:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names: list[str] = []
            for node in cls.body:  # class attributes, dataclass fields, __slots__
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                for t in targets:
                    if isinstance(t, ast.Name):
                        names.append(t.id)
                        if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                            names += [
                                e.value
                                for e in node.value.elts
                                if isinstance(e, ast.Constant) and isinstance(e.value, str)
                            ]
            for node in ast.walk(cls):  # self._x = ... (also inside tuple targets) in its methods
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets = [node.target]
                for t in targets:
                    for a in ast.walk(t):
                        if (
                            isinstance(a, ast.Attribute)
                            and isinstance(a.value, ast.Name)
                            and a.value.id in ("self", "cls")
                        ):
                            names.append(a.attr)
            for name in names:
                if _private(name):
                    out.setdefault(name, set()).add(rel)
    return out


#: builtins that read or write an attribute named by a string: getattr(obj, "_name") is obj._name
BY_NAME = ("getattr", "setattr", "hasattr", "delattr")


def foreign_private_reads(rel: str, tree: ast.Module, defined: dict[str, set[str]]) -> list[tuple[int, str]]:
    """`expr._name` (or `getattr(expr, "_name")`, `setattr`, `hasattr`, `delattr`) in file `rel` where `_name` is a
    private attribute of a package class defined in another file (`self._name` / `cls._name` aside)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            obj, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            obj, name = node.args[0], node.args[1].value
        else:
            continue
        if (
            name in defined
            and rel not in defined[name]
            and not (isinstance(obj, ast.Name) and obj.id in ("self", "cls"))
        ):
            out.add((node.lineno, ast.unparse(node)))
    return sorted(out)


def torch_patches(tree: ast.Module) -> list[tuple[int, str]]:
    """Assignments to an attribute of torch (torch.X = ..., torch.Tensor.y = ..., setattr(torch.Tensor, ...))."""

    def rooted_at_torch(expr: ast.expr) -> bool:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id == "torch"

    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = node.args[:1]
            if targets and rooted_at_torch(targets[0]):
                out.append((node.lineno, ast.unparse(node)))
            continue
        out += [(node.lineno, ast.unparse(t)) for t in targets if isinstance(t, ast.Attribute) and rooted_at_torch(t)]
    return out


def _check(finder, pending: dict[str, str], what: str) -> None:
    found = {rel: hits for rel, tree in _sources() if (hits := finder(rel, tree))}
    unexpected = {rel: hits for rel, hits in found.items() if rel not in pending}
    assert not unexpected, f"{what} outside the allowed places: {unexpected}"
    stale = sorted(set(pending) - set(found))
    assert not stale, f"allowlist entries whose file no longer has {what} (remove them): {stale}"


def test_release_ranges_live_in_compat():
    def finder(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
        return [] if rel.startswith("compat/") or rel == SANDBOX_RELEASES else release_literals(tree)

    _check(finder, PENDING_RELEASE_LITERALS, "release-range literals")


def test_no_underscore_name_crosses_modules():
    _check(private_uses, PENDING_PRIVATE_IMPORTS, "underscore names of other modules")


def test_no_runtime_patch_of_torch():
    _check(lambda rel, tree: torch_patches(tree), {}, "assignments to torch attributes")


def test_no_private_attribute_of_another_modules_class():
    defined = private_attributes(_sources())
    _check(
        lambda rel, tree: foreign_private_reads(rel, tree, defined), {}, "reads of another module's private attributes"
    )


def test_no_runtime_module_over_the_line_limit():
    def finder(rel: str, tree: ast.Module) -> list[tuple[int, str]]:
        n = len((PACKAGE / rel).read_text().splitlines())
        return [(n, f"{n} lines > {MAX_LINES}")] if n > MAX_LINES else []

    _check(finder, PENDING_LONG_MODULES, f"modules over {MAX_LINES} lines")


def test_compat_imports_nothing_above_it():
    _check(upward_imports, {}, "imports of the package above compat/")


def test_the_runtime_neither_imports_nor_names_the_sandbox():
    names = sandbox_names()
    assert "random_nvfp4_checkpoint" in names  # the finder sees the sandbox's functions
    _check(lambda rel, tree: sandbox_uses(rel, tree, names), {}, "uses of the sandbox by the runtime")


def test_the_sandbox_is_an_extension_of_the_plugin():
    """Registered in the plugin's own entry-point group (setup.cfg), as a third-party extension is."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    group = {
        line.split("=")[0].strip(): line.split("=", 1)[1].strip()
        for line in cfg["options.entry_points"]["sglang_trtllm_moe"].strip().splitlines()
    }
    assert group.get("sandbox") == f"{NAME}.sandbox.extension", group


def test_compat_holds_release_facts_only():
    present = sorted(p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "compat").glob("*.py"))
    assert present == sorted(COMPAT_MODULES), (
        f"compat/ holds {present}, COMPAT_MODULES lists {sorted(COMPAT_MODULES)}: compat/ is for release facts; "
        "a stand-in or a test switch belongs in sandbox/, a new release fact is listed with what it holds"
    )
    readers = [p.name for p in (PACKAGE / "compat").glob("*.py") if SANDBOX_SWITCH in p.read_text()]
    assert not readers, f"{readers} read the sandbox's switch {SANDBOX_SWITCH}: that is sandbox/switches.py's"


def test_the_sandbox_use_finder():
    src = (
        "from .sandbox import layers\n"
        'def f():\n    """The CPU sandbox (prose is fine)."""\n'
        '    import importlib\n    importlib.import_module("sglang_trtllm_moe.sandbox.standins")\n'
        '    return "random_nvfp4_checkpoint", st.sandbox\n'
    )
    hits = sandbox_uses("cli.py", ast.parse(src), {"random_nvfp4_checkpoint"})
    assert [line for line, _ in hits] == [1, 5, 5, 6, 6], hits
    assert sandbox_uses("sandbox/layers.py", ast.parse(src), set()) == []


def test_compat_leaves_are_leaves():
    for mod in COMPAT_MAY_IMPORT:
        rel = mod[len(NAME) + 1 :].replace(".", "/") + ".py"
        hits = package_imports(rel, ast.parse((PACKAGE / rel).read_text()))
        assert not hits, f"{rel} may be imported by compat/ only as a leaf, but it imports {hits}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ('X = ">=0.5.16"', [(1, ">=0.5.16")]),
        ('def f():\n    """Before 0.5.19 (>=0.5.11 prose)."""\n    return "<0.5.21"', [(3, "<0.5.21")]),
        ('why = "0.5.19+ allocates I rows"', []),
    ],
)
def test_the_release_literal_finder(source, expected):
    assert release_literals(ast.parse(source)) == expected


def test_the_private_use_finder():
    src = (
        "from .maps import _cached, cached\n"
        "from . import _triton\n"
        "from .. import layouts\n"
        "from sglang.srt.plugins.hook_registry import _current_plugin_source\n"
        "layouts.maps._round_up(1, 2)\n"
        "layouts.maps.round_up(1, 2)\n"
    )
    hits = private_uses("layouts/fastpath.py", ast.parse(src))
    assert hits == [
        (1, f"from {NAME}.layouts.maps import _cached"),
        (5, "layouts.maps._round_up"),
    ], hits


def test_the_upward_import_finder():
    src = (
        "from . import features\n"
        "from .releases import installed_version\n"
        "from .. import layer_attrs, env\n"
        "from ..formats import BF16\n"
        "def f():\n"
        "    from ..runner import emulating\n"
        "    from .. import PROJECT_NAME\n"
        "    import sglang_trtllm_moe.selection\n"
        "    importlib.import_module('sglang_trtllm_moe.layer_state')\n"
    )
    hits = upward_imports("compat/defer.py", ast.parse(src))
    assert hits == [
        (3, f"{NAME}.env"),
        (4, f"{NAME}.formats"),
        (6, f"{NAME}.runner"),
        (7, NAME),
        (8, f"{NAME}.selection"),
        (9, f"{NAME}.layer_state"),
    ], hits
    assert upward_imports("runner.py", ast.parse(src)) == []


def test_the_foreign_private_read_finder():
    owner = (
        "from dataclasses import dataclass, field\n"
        "@dataclass\n"
        "class State:\n"
        "    _mirror: dict = field(default_factory=dict)\n"
        "    def f(self):\n"
        "        self._bits, self.n = [], 0\n"
        "        return self._mirror\n"
        "class Job:\n"
        "    __slots__ = ('_refuse', 'name')\n"
    )
    defined = private_attributes([("layer_state.py", ast.parse(owner))])
    assert defined == {"_mirror": {"layer_state.py"}, "_bits": {"layer_state.py"}, "_refuse": {"layer_state.py"}}
    reader = (
        "def g(st, layer, job):\n"
        "    m = st._mirror.get('w13')\n"
        "    job._refuse = None\n"
        "    layer._weight_loader_impl(1)\n"
        "    torch._foreach_copy_([], [])\n"
        "    return mask._version, st.__dict__\n"
        "def h(st, self):\n"
        "    return getattr(st, '_bits', None), hasattr(self, '_bits'), getattr(st, '_weight_loader_impl')\n"
    )
    hits = foreign_private_reads("builtins/loader_hooks.py", ast.parse(reader), defined)
    assert hits == [(2, "st._mirror"), (3, "job._refuse"), (8, "getattr(st, '_bits', None)")], hits
    assert foreign_private_reads("layer_state.py", ast.parse(reader), defined) == []


def test_the_torch_patch_finder():
    src = "import torch\ntorch.Tensor.cuda = lambda t: t\nsetattr(torch.Tensor, 'cuda', None)\nx.cuda = 1\n"
    assert [n for n, _ in torch_patches(ast.parse(src))] == [2, 3]
