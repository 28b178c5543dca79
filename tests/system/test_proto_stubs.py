"""The committed gRPC stubs are what tools/gen_proto.py generates now, and the proto lints clean."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "tools" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    gen = _load_gen_proto()
    fresh = gen.generate(tmp_path)
    committed = gen.generated_paths(gen.DEFAULT_OUT)
    assert all(p.parent == REPO / "proto/kvserve/v1" for p in committed)  # beside generation.proto
    assert len(fresh) == len(committed) == 3
    for new, old in zip(fresh, committed):
        assert old.exists(), f"{old} is missing: run python tools/gen_proto.py"
        assert new.read_bytes() == old.read_bytes(), (
            f"{old.relative_to(REPO)} is stale: run python tools/gen_proto.py and commit"
        )


def test_stub_imports_resolve_inside_the_package() -> None:
    from kvserve.proto.kvserve.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "kvserve.v1"
    assert "GenerationService" in generation_pb2.DESCRIPTOR.services_by_name
    assert generation_pb2_grpc.GenerationServiceStub is not None
    here = (REPO / "proto/kvserve/v1/generation_pb2.py").resolve()  # beside the .proto (kvserve/proto links there)
    assert Path(generation_pb2.__file__).resolve() == here
    assert generation_pb2_grpc.kvserve_dot_v1_dot_generation__pb2 is generation_pb2  # the one module, not a copy
    grpc_src = (REPO / "proto/kvserve/v1/generation_pb2_grpc.py").read_text()
    assert "\nfrom kvserve.v1 " not in grpc_src  # protoc's import, rewritten into the package
    assert "\nfrom . import generation_pb2 as " in grpc_src


def test_buf_lint_clean() -> None:
    assert shutil.which("buf") is not None, "the buf CLI is missing: it comes with the test extra (pip install buf-bin)"
    proc = subprocess.run(["buf", "lint"], cwd=REPO / "proto", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_message_and_field_has_a_comment() -> None:
    """Independent of buf: a leading comment on each message, enum, field and value."""
    lines = (REPO / "proto/kvserve/v1/generation.proto").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        s = line.strip()
        declares = s.startswith(("message ", "enum ", "rpc ", "oneof ")) or (
            s.endswith(";") and "=" in s and not s.startswith(("syntax", "option"))
        )
        if declares and not lines[i - 1].strip().startswith("//"):
            missing.append(f"{i + 1}: {s}")
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)
