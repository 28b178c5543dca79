"""Native CPU kernels for decode: C++ (AVX2 + FMA, own thread pool) called through ctypes.

Decode reads every weight once per token, so its speed is the speed of a one-row
product; torch's CPU kernels for that are slower than the memory allows (MKL's
float32 GEMV), scalar (the int8 weight-only kernel on AVX2) or missing (bfloat16 on
CPUs without AVX-512 BF16). The kernels here read the weights in their own storage
((out, in) row-major: float32, bfloat16, int8 with per-row scales), so nothing is
repacked or copied.

Built on first use from the sources beside this file with the system C++ compiler
(``c++``, a few seconds; AVX2/FMA code, not ``-march=native``, so a library built on
one x86-64 machine runs on any with those), cached by source and flags under
``$XDG_CACHE_HOME/kvserve/native`` (default ``~/.cache/kvserve/native``) and loaded with
ctypes; a library already in the cache needs no compiler (the container image builds
one in its build stage). Where it cannot be built or loaded (no compiler and nothing
cached; a CPU without AVX2/FMA; not x86-64), ``available()`` is False, ``reason()``
says why in one line and every caller keeps its torch path.

Threads: ``pool.h``, a work-claiming pool (not OpenMP's fork-join: a thread the OS
has not scheduled does not hold the others up); each call is told torch's thread
count.

The ``native_kernels`` setting (``MODES``) is applied by ``loading.load_model``: ``auto``
uses the kernels when they build, ``on`` refuses to load without them, ``off`` never
loads them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path


MODES = ("auto", "on", "off")
SOURCES = ("pool.cpp", "gemv.cpp", "decode.cpp", "layer.cpp")
HEADERS = ("pool.h",)
_HERE = Path(__file__).resolve().parent
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno", "-ffp-contract=off"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is unavailable (None: not tried yet, or loaded)
_tried = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvserve")
    return Path(root) / "native"


def _compiler() -> str | None:
    import shutil

    for cc in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_path() -> Path:
    """Where the library for these sources and flags is (or will be) cached."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((_HERE / name).read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    return _cache_dir() / f"libkvnative-{digest.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    """Find the cached library or compile it, and load it; raises RuntimeError with one line."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"native kernels are x86-64 only (this is {platform.machine()})")
    missing = sorted({"avx2", "fma", "f16c"} - _cpu_flags())
    if missing:
        raise RuntimeError(f"native kernels need AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}")
    target = library_path()
    if not target.exists():  # a prebuilt library (the container image ships one) needs no compiler
        cc = _compiler()
        if cc is None:
            raise RuntimeError("native kernels need a C++ compiler (c++, g++ or clang++); none found")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # build aside, rename: safe across processes
        except OSError as e:
            raise RuntimeError(f"native kernels: cannot write the cache {target.parent}: {e.strerror}") from None
        os.close(fd)
        cmd = [cc, *_FLAGS, *(str(_HERE / s) for s in SOURCES), "-o", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            os.unlink(tmp)
            raise RuntimeError(f"native kernels: compiling failed: {e}") from None
        if done.returncode != 0:
            os.unlink(tmp)
            first = next((l for l in done.stderr.splitlines() if "error" in l), done.stderr.strip()[:200])
            raise RuntimeError(f"native kernels: {cc} failed: {first}")
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("kv_gemv_f32", "kv_gemv_bf16", "kv_gemv_i8"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, i32, i32]
        fn.restype = None
    lib.kv_gemv_q8.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, i32, i32, p, p]
    lib.kv_gemv_q8.restype = None
    f32 = ctypes.c_float
    lib.kv_rmsnorm.argtypes = [p, i64, i64, i64, p, f32, f32, p, i64]
    lib.kv_rope.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, p]
    lib.kv_act_mul.argtypes = [p, i64, i64, i64, i32, p, i32]
    lib.kv_decode_attention.argtypes = [p, i64, p, p, i64, i64, i64, i64, i64, p, i64, i64, i64,
                                        p, p, p, i64, p, i64, f32, f32, p, i32]
    lib.kv_decode_layer.argtypes = [p, p, p, p, p, i64]
    for name in ("kv_rmsnorm", "kv_rope", "kv_act_mul", "kv_decode_attention", "kv_decode_layer"):
        getattr(lib, name).restype = None


def load() -> ctypes.CDLL | None:
    """The loaded library, building it on first call; None where it cannot be (``reason()``)."""
    global _lib, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (RuntimeError, OSError) as e:
                _reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _lib


def available() -> bool:
    return load() is not None


def reason() -> str | None:
    """One line saying why the kernels are unavailable (None when they are loaded)."""
    load()
    return _reason
