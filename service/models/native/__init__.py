"""Native CPU kernels for decode: C++ (AVX2 + FMA or AVX-512 + VNNI, own thread pool)
called through ctypes.

Decode reads every weight once per token, so its speed is the speed of a one-row
product; torch's CPU kernels for that are slower than the memory allows (MKL's
float32 GEMV), scalar (the int8 weight-only kernel on AVX2) or missing (bfloat16 on
CPUs without AVX-512 BF16). The kernels here read the weights in their own storage
((out, in) row-major: float32, bfloat16, int8 with per-row scales), so nothing is
repacked or copied.

Built on first use from the sources beside this file with the system C++ compiler
(``c++``, a few seconds) at the best ISA level the CPU runs (``ISAS``: AVX-512 with
VNNI, else AVX2 + FMA; explicit flags, not ``-march=native``, so a library built on one
x86-64 machine runs on any with that level), cached by source, flags and level under
``$XDG_CACHE_HOME/kvserve/native`` (default ``~/.cache/kvserve/native``) and loaded with
ctypes; a library already in the cache needs no compiler (the container image compiles
every level in its build stage: ``compile_all``). Where it cannot be built or loaded (no
compiler and nothing cached; a CPU without AVX2/FMA; not x86-64), ``available()`` is
False, ``reason()`` says why in one line and every caller keeps its torch path.

Threads: ``pool.h``, a work-claiming pool (not OpenMP's fork-join: a thread the OS
has not scheduled does not hold the others up); each call is told torch's thread
count.

The ``native_kernels`` setting (``MODES``) is applied by ``loading.load_model``: ``auto``
uses the kernels when they build, ``on`` refuses to load without them, ``off`` never
loads them."""

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
_FLAGS = ["-O3", "-pthread", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno", "-ffp-contract=off", "-Wl,-Bsymbolic"]
# ISA levels, best first: (name, compiler flags, the /proc/cpuinfo flags the CPU needs).
# The library is built for the best level this CPU has; gemv.cpp's AVX-512 products
# (512-bit, and VNNI's byte dot for w8a8) are compiled in when its flags are on.
ISAS = (
    ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
     {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    ("avx2", ["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_isa: str | None = None  # the ISA level of the loaded library
_reason: str | None = None  # why the library is unavailable (None: not tried yet, or loaded)
_tried = False


def passive_openmp(environ=os.environ) -> None:
    """Ask torch's OpenMP threads to sleep between parallel ops instead of spinning
    (``OMP_WAIT_POLICY=PASSIVE``, unless the environment already says). libgomp's default
    spins each idle thread for a while after every parallel op; on a host with few cores
    that spinning takes the cores this library's own threads need, as soon as a step runs
    one torch op big enough to go parallel (the logits of a batch: a batch-8 step at ~110M
    w8a8 on 2 cores took 21 ms instead of 13). libgomp reads this once, when torch loads,
    so callers (the server's command line, the benchmarks) call it before importing torch."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def _isa_flags(isa: str) -> list[str]:
    for name, flags, _ in ISAS:
        if name == isa:
            return flags
    raise ValueError(f"unknown ISA level {isa!r}; one of {', '.join(n for n, _, _ in ISAS)}")


def cpu_isas() -> list[str]:
    """The ISA levels this CPU runs, best first (empty: none; not x86-64 or no AVX2)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = _cpu_flags()
    return [name for name, _, needs in ISAS if needs <= have]


def library_path(isa: str | None = None) -> Path:
    """Where the library for these sources, flags and ISA level (default: the best this
    CPU runs, else AVX2) is (or will be) cached."""
    isa = isa or (cpu_isas() or ["avx2"])[0]
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((_HERE / name).read_bytes())
    digest.update(" ".join(_FLAGS + _isa_flags(isa)).encode())
    return _cache_dir() / f"libkvnative-{isa}-{digest.hexdigest()[:16]}.so"


def build(isa: str) -> ctypes.CDLL:
    """The library for one ISA level, compiled (or found in the cache) and loaded; raises
    RuntimeError with one line. It runs only on a CPU that has the level (``cpu_isas``)."""
    lib = ctypes.CDLL(str(compile_library(isa)))
    _declare(lib)
    return lib


def compile_all() -> dict[str, str]:
    """Compile the library at every ISA level into the cache, loading none (any level
    compiles on any x86-64 host: the container image's build stage, whose runtime has no
    compiler, prepares every level for whatever host it runs on). {isa: path or why not}."""
    done = {}
    for isa, _, _ in ISAS:
        try:
            done[isa] = str(compile_library(isa))
        except RuntimeError as e:
            done[isa] = str(e)
    return done


def compile_library(isa: str) -> Path:
    """The cached library file for one ISA level, compiled when missing; RuntimeError with
    one line when it cannot be."""
    target = library_path(isa)
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
        try:
            compile_sources(_HERE, isa, Path(tmp), cc)
        except RuntimeError:
            os.unlink(tmp)
            raise
        os.replace(tmp, target)
    return target


def compile_sources(source_dir: Path, isa: str, out: Path, cc: str | None = None) -> None:
    """Compile the library's ``SOURCES`` found in ``source_dir`` (this package's, or
    another revision's: bench/bench_kernels.py) at ``isa`` into ``out``, with this
    package's flags; RuntimeError with one line when it cannot be."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("native kernels need a C++ compiler (c++, g++ or clang++); none found")
    cmd = [cc, *_FLAGS, *_isa_flags(isa), *(str(source_dir / s) for s in SOURCES), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"native kernels: compiling failed: {e}") from None
    if done.returncode != 0:
        first = next((l for l in done.stderr.splitlines() if "error" in l), done.stderr.strip()[:200])
        raise RuntimeError(f"native kernels: {cc} failed: {first}")


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


def _best() -> tuple[str, ctypes.CDLL]:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"native kernels are x86-64 only (this is {platform.machine()})")
    isas = cpu_isas()
    if not isas:
        missing = sorted(ISAS[-1][2] - _cpu_flags())
        raise RuntimeError(f"native kernels need AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}")
    return isas[0], build(isas[0])


def load() -> ctypes.CDLL | None:
    """The loaded library (the best ISA level this CPU runs), building it on first call;
    None where it cannot be (``reason()``)."""
    global _lib, _isa, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _isa, _lib = _best()
            except (RuntimeError, OSError) as e:
                _reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _lib


def select(isa: str) -> None:
    """Serve with the library of this ISA level instead of the best one (benchmarks and
    tests compare the levels); RuntimeError when this CPU lacks it or it cannot build."""
    global _lib, _isa, _reason, _tried
    if isa not in cpu_isas():
        raise RuntimeError(f"native kernels: this CPU does not run {isa} (it runs: {', '.join(cpu_isas()) or 'none'})")
    lib = build(isa)
    with _lock:
        _lib, _isa, _reason, _tried = lib, isa, None, True


def isa() -> str | None:
    """The ISA level of the loaded library ("avx512" or "avx2"; None when unavailable)."""
    load()
    return _isa


def available() -> bool:
    return load() is not None


def reason() -> str | None:
    """One line saying why the kernels are unavailable (None when they are loaded)."""
    load()
    return _reason
