#!/usr/bin/env python3
"""Regenerate the committed Python stubs of ``proto/kvserve/v1/*.proto``.

    python tools/gen_proto.py                # writes proto/kvserve/v1/*_pb2*.py[i], beside the .proto
    python tools/gen_proto.py --out /tmp/x   # writes /tmp/x/kvserve/v1/... (the staleness test)

The stubs live beside their source in proto/, the ``kvserve.proto`` package that the
server (service/) and the clients (clients/) both import: ``kvserve.proto.kvserve.v1``.
protoc names imports after the proto package (``from kvserve.v1 import ...``), which would
resolve nowhere; one post-processing step makes them relative (``from . import ...``: the
stubs of one proto package import each other inside it, as every package here does).
Nothing else is edited, so the output is otherwise byte-for-byte what ``grpc_tools.protoc``
of the installed grpcio-tools writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
PROTO_FILES = ("kvserve/v1/generation.proto",)
DEFAULT_OUT = PROTO_ROOT  # protoc writes kvserve/v1/x_pb2.py under it: beside kvserve/v1/x.proto
IMPORT_REWRITES = (("from kvserve.v1 import ", "from . import "),)


def generated_paths(out: Path) -> list[Path]:
    """The files ``generate(out)`` writes, one triple per proto file."""
    paths = []
    for proto in PROTO_FILES:
        stem = out / proto.removesuffix(".proto")
        paths += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return paths


def generate(out: Path = DEFAULT_OUT) -> list[Path]:
    """Run protoc (python, pyi and grpc plugins) into ``out`` and fix the imports."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(PROTO_ROOT / p) for p in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    paths = generated_paths(out)
    for path in paths:
        text = path.read_text()
        for old, new in IMPORT_REWRITES:
            text = text.replace(old, new)
        path.write_text(text)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output root (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
