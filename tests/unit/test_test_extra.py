"""The test extra is complete: every third-party module that tests/ imports (``import``,
``from ... import``, ``pytest.importorskip``), anywhere in a file, is provided by a
distribution that pyproject.toml declares among the core dependencies or the ``test``
extra, and every one bench/ imports by one of those or the ``bench`` extra. A module that
is installed on this machine's image but comes from no declared distribution would pass
here and fail to import in a fresh virtualenv (`.ci/run` runs the suite in one)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"kvserve", "tests", "bench"} | {p.stem for d in ("bench", "tools") for p in (REPO / d).glob("*.py")}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


@functools.cache
def _providers() -> dict[str, list[str]]:
    return md.packages_distributions()  # module -> the installed distributions providing it


def _imports(path: Path) -> set[str]:
    """The top-level module names a file imports, at any depth, absolute imports only."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))  # fmt: skip
    return {n.split(".")[0] for n in names}


def _undeclared(folder: str, extras: tuple[str, ...]) -> dict[str, list[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for extra in extras:
        declared |= {_name(r) for r in project["optional-dependencies"][extra]}
    providers = _providers()
    missing: dict[str, list[str]] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        for module in _imports(path) - FIRST_PARTY - set(sys.stdlib_module_names):
            # not installed here (an extra this image lacks): the distribution of the module's name
            dists = {_name(d) for d in providers.get(module, [])} or {_name(module)}
            if not dists & declared:
                missing.setdefault(f"{module} (from {', '.join(sorted(dists))})", []).append(
                    str(path.relative_to(REPO)))
    return missing


def test_every_module_the_tests_import_comes_from_the_test_extra_or_the_core() -> None:
    missing = _undeclared("tests", ("test",))
    assert not missing, f"imported by tests but not declared in pyproject.toml's test extra: {missing}"


def test_every_module_the_benchmarks_import_comes_from_a_declared_extra() -> None:
    missing = _undeclared("bench", ("test", "bench"))
    assert not missing, f"imported by bench/ but declared in no extra: {missing}"


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    """The scan finds imports at any depth and importorskip's, and knows the standard library."""
    f = tmp_path / "t.py"
    f.write_text("import os\nimport scipy.stats\ndef f():\n    from yaml import safe_load\n"
                 "    import pytest\n    pytest.importorskip('litellm')\n")  # fmt: skip
    assert _imports(f) - set(sys.stdlib_module_names) == {"scipy", "yaml", "pytest", "litellm"}
    assert _name("redis[hiredis]>=5.0") == "redis" and _name("Foo_Bar.baz==1") == "foo-bar-baz"
