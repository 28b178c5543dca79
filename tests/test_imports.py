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
    assert _runs_without_torch("import service.engine").returncode != 0


def test_domain_types_import_without_torch():
    out = _runs_without_torch("import service.types as t; assert t.SamplingParams().max_new_tokens > 0")
    assert out.returncode == 0, out.stderr


def test_clients_and_their_stubs_import_without_torch_or_the_server():
    code = (
        "import clients, clients.chat\n"
        "from clients._proto.kvserve.v1 import generation_pb2\n"
        "assert not [m for m in sys.modules if m == 'service' or m.startswith(('service.', 'cachestore'))]\n"
    )
    out = _runs_without_torch(code)
    assert out.returncode == 0, out.stderr
