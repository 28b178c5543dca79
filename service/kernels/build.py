"""Building the native kernels: one shared library per ISA level, from ``src/``.

The project's build runs this (setup.py's ``build_ext``: ``pip install .`` and
``pip install -e .`` both), so an installed kvserve carries ``libkvkernels-<isa>.so``
for every level beside this file and never compiles at start; ``kernels.load`` picks
the best level the CPU runs (as ggml-cpu's GGML_CPU_ALL_VARIANTS). A developer who
changes a source rebuilds in place with::

    python -m kvserve.service.kernels        # or: pip install -e .

Why setuptools' ``build_ext`` and not CMake through scikit-build-core: the libraries
are plain C++ (no Python API) loaded through ctypes, four sources and one compiler
command per level; the project's build is already setuptools (``setup.py`` maps the
folders to the ``kvserve.*`` names), and an editable install's ``build_ext`` writes the
libraries in place, where the checkout's code finds them. CMake would add a build
dependency and a second build description for the same command.

This file imports nothing but the standard library: setup.py loads it by path, before
the package is installed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parent / "src"
SOURCES = ("pool.cpp", "gemv.cpp", "gemm.cpp", "qblocks.cpp", "attention.cpp", "decode.cpp", "layer.cpp")
HEADERS = ("kvkernels.h", "pool.h", "reduce.h", "tile.h")
FLAGS = ("-O3", "-pthread", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno", "-ffp-contract=off", "-Wl,-Bsymbolic")
# ISA levels, best first: (name, compiler flags, the /proc/cpuinfo flags the CPU needs).
# Explicit flags, not -march=native: a library built on one x86-64 machine runs on any
# with its level. gemv.cpp's AVX-512 products (512-bit, VNNI's byte dot for w8a8) are
# compiled in when its flags are on.
ISAS = (
    ("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
     frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})),
    ("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
)  # fmt: skip


def library_name(isa: str) -> str:
    return f"libkvkernels-{isa}.so"


def isa_flags(isa: str) -> tuple[str, ...]:
    for name, flags, _ in ISAS:
        if name == isa:
            return flags
    raise ValueError(f"unknown ISA level {isa!r}; one of {', '.join(n for n, _, _ in ISAS)}")


def source_digest(isa: str, src: Path = SRC) -> str:
    """sha256 (16 hex) of the sources and headers in ``src`` and the flags for ``isa``:
    what a library was built from (``kv_build_id``), compared at load with the sources
    beside it so a stale build is never served."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        if not (src / name).is_file():  # another revision's sources (bench_kernels --against) may lack one
            continue
        data = (src / name).read_bytes()
        h.update(name.encode() + len(data).to_bytes(8, "little") + data)
    h.update(" ".join((*FLAGS, *isa_flags(isa))).encode())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    for cc in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cc and shutil.which(cc):
            return cc
    return None


def compiler_id(cc: str) -> str:
    """The compiler's first ``--version`` line, spaces as underscores (part of a build's id)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc
    return (out.splitlines() or [cc])[0].strip().replace(" ", "_")


def build_id_of(path: Path) -> str | None:
    """The ``kv_build_id`` string a built library carries, read without loading it."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    at = data.find(b"kvkernels-build:")
    if at < 0:
        return None
    return data[at + len(b"kvkernels-build:") : data.index(b"\0", at)].decode(errors="replace")


def compile_sources(src: Path, isa: str, out: Path, cc: str | None = None,
                    sources: tuple[str, ...] = SOURCES) -> None:
    """Compile ``src``'s ``sources`` (this package's SOURCES, or another revision's .cpp
    files: bench/bench_kernels.py) at ``isa`` into ``out``, written aside and renamed (a
    process that has the old file loaded keeps its copy); RuntimeError with one line."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("native kernels need a C++ compiler (c++, g++ or clang++); none found")
    build_id = f"kvkernels-build:{source_digest(isa, src)} {compiler_id(cc)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *FLAGS, *isa_flags(isa), f'-DKV_BUILD_ID="{build_id}"', f"-I{src}", *(str(src / s) for s in sources),
           "-o", tmp]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise RuntimeError(f"native kernels: compiling failed: {e}") from None
    if done.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
        raise RuntimeError(f"native kernels: {cc} failed: {first}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)


def build(out_dir: Path, log=print, isas: tuple[str, ...] | None = None) -> dict[str, str]:
    """Every ISA level's library into ``out_dir`` (``library_name``), skipping a level
    whose library there was built from the same sources by the same compiler. Never
    raises: on a host that cannot build (not x86-64, no compiler) it logs why and the
    installed kvserve serves with torch's kernels. {isa: "built" | "up to date" | why not}."""
    if platform.machine() not in ("x86_64", "AMD64"):
        log(f"native kernels: not built (x86-64 only; this is {platform.machine()}): torch's kernels will serve")
        return {}
    cc = compiler()
    if cc is None:
        log("native kernels: not built (no C++ compiler: c++, g++ or clang++): torch's kernels will serve")
        return {}
    cid = compiler_id(cc)
    done = {}
    for isa, _, _ in ISAS:
        if isas is not None and isa not in isas:
            continue
        out = out_dir / library_name(isa)
        if build_id_of(out) == f"{source_digest(isa)} {cid}":
            done[isa] = "up to date"
            continue
        log(f"native kernels: compiling {library_name(isa)} with {cc} -O3 (about 10-30 s)")
        try:
            compile_sources(SRC, isa, out, cc)
            done[isa] = "built"
        except RuntimeError as e:
            log(str(e))
            done[isa] = str(e)
    return done


def main() -> int:
    """``python -m kvserve.service.kernels``: every level's library in place, beside build.py."""
    result = build(Path(__file__).resolve().parent, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(" ".join(f"{isa}: {state}" for isa, state in result.items()) or "nothing built")
    return 0 if result and all(s in ("built", "up to date") for s in result.values()) else 1
