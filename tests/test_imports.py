"""What must import without torch: the domain types (the front and the clients name them
without loading the engine) and the Python clients with their generated stubs."""

from __future__ import annotations

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


def test_tool_calling_imports_without_torch_or_grpc():
    """service/tools is pure Python (the Responses API and tests reuse it without the engine)."""
    out = _runs_without_torch("sys.modules['grpc'] = None\nimport kvserve.service.tools as t; assert t.FAMILIES")
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
        assert ".engine.engine" not in source and ".store" not in source, f"service/{name}.py reaches into the engine"
