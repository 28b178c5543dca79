"""What must import without torch: the domain types (the front and the clients name them
without loading the engine) and the Python clients with their generated stubs."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.serving import REPO, subprocess_env

_NO_TORCH = "import sys; sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"


def _runs_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + code], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_blocker_works():
    assert _runs_without_torch("import kvserve.service.engine").returncode != 0


def test_domain_types_import_without_torch():
    out = _runs_without_torch("import kvserve.service.types as t; assert t.SamplingParams().max_new_tokens > 0")
    assert out.returncode == 0, out.stderr


def test_clients_and_their_stubs_import_without_torch_or_the_server():
    code = (
        "import kvserve.clients, kvserve.clients.chat\n"
        "from kvserve.clients._proto.kvserve.v1 import generation_pb2\n"
        "assert not [m for m in sys.modules if m.startswith(('kvserve.service', 'kvserve.cachestore'))]\n"
    )
    out = _runs_without_torch(code)
    assert out.returncode == 0, out.stderr


def test_the_front_names_no_engine_or_store_internals():
    """servicer, wire and conversations talk to the engine through AsyncEngine's methods
    (imported for type checking only) and to the store not at all."""
    import ast

    for name in ("servicer", "wire", "conversations"):
        tree = ast.parse((REPO / "service" / f"{name}.py").read_text())
        type_checking = {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        imported = [
            node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and id(node) not in type_checking and node.module
        ]
        inner = [m for m in imported if m.startswith(("kvserve.cachestore", "kvserve.service.engine", "kvserve.service.kv", "torch"))]
        assert not inner, f"service/{name}.py imports {inner}"
        source = (REPO / "service" / f"{name}.py").read_text()
        assert ".engine.engine" not in source and not re.search(r"\.store\b", source), f"service/{name}.py reaches into the engine"


def _imports(path) -> list[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
             for a in n.names]  # fmt: skip
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], f"{path}: relative import"
    return names


def test_the_kernels_import_nothing_from_the_models_or_the_engine():
    """service/kernels/ knows arrays, never modules: the model code hands it typed views
    of its weights, so the arrow goes models -> kernels and never back."""
    files = sorted((REPO / "service" / "kernels").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "build.py", "binding.py", "ops.py", "layer.py"}
    for f in files:
        inner = [m for m in _imports(f) if m.startswith("kvserve.") and not m.startswith("kvserve.service.kernels")]
        assert not inner, f"service/kernels/{f.name} imports {inner}"


def test_the_kernels_loader_and_build_import_without_torch():
    """setup.py loads build.py by path before anything is installed; the command line
    sets OpenMP's wait policy through the loader before torch loads."""
    out = _runs_without_torch("from kvserve.service import kernels\nfrom kvserve.service.kernels import build, binding\n"
                              "kernels.passive_openmp(); binding.header_binding()\n")
    assert out.returncode == 0, out.stderr
    assert all(m.split(".")[0] in sys.stdlib_module_names or m.startswith("kvserve.service.kernels")
               for m in _imports(REPO / "service" / "kernels" / "build.py")), "build.py: standard library only"
