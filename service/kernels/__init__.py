"""Native CPU kernels for decode: C++ (AVX2 + FMA or AVX-512 + VNNI, own thread pool)
called through ctypes. They know arrays, never modules: nothing here imports from
``models/``; the model code hands them typed views of its weights (``layer.py``).

Decode reads every weight once per token, so its speed is the speed of a one-row
product; torch's CPU kernels for that are slower than the memory allows (MKL's float32
GEMV), scalar (the int8 weight-only kernel on AVX2) or missing (bfloat16 on CPUs
without AVX-512 BF16). The kernels read the weights in their own storage ((out, in)
row-major: float32, bfloat16, int8 with per-row scales, or ggml's blocks as a GGUF file
stores them: src/qblocks.cpp), so nothing is repacked.

The room:

    src/kvkernels.h   the one header: every entry point and struct; every source includes it
    src/*.cpp         products (gemv), norms, RoPE, gates, attention (decode), the layer, the pool
    build.py          one library per ISA level, built by the project's build (setup.py),
                      ``python -m kvserve.service.kernels`` in place for a developer
    binding.py        the ctypes binding generated from the header
    ops.py            torch-facing entry points with argument checks (one ctypes call each)
    layer.py          the weight views, products, norms, gates and the decoder-layer stack

``load()`` (this file, torch-free) opens the library beside this file built for the
best ISA level the CPU runs (``ISAS``: AVX-512 with VNNI, else AVX2 + FMA) and binds it:
no compiler runs at start. Where there is none for this CPU (not x86-64, no AVX2/FMA, a
wheel built without a compiler), or it was built from other sources than those beside
it (a developer's edit: rebuild), ``available()`` is False, ``reason()`` says why in one
line and the model keeps torch's kernels.

The ``native_kernels`` setting (``MODES``) is applied by ``models.loading.load_model``:
``auto`` uses the kernels where they load, ``on`` refuses to load without them, ``off``
never loads them.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

from . import build as _build
from .binding import header_binding

MODES = ("auto", "on", "off")
ISAS = _build.ISAS
HERE = Path(__file__).resolve().parent


def passive_openmp(environ=os.environ) -> None:
    """Ask torch's OpenMP threads to sleep between parallel ops instead of spinning
    (``OMP_WAIT_POLICY=PASSIVE``, unless the environment already says). libgomp's default
    spins each idle thread for a while after every parallel op; on a host with few cores
    that spinning takes the cores the kernels' own threads need, as soon as a step runs
    one torch op big enough to go parallel (the logits of a batch; docs/benchmarks.md,
    decode-omp-passive). libgomp reads this once, when torch loads,
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


def cpu_isas() -> list[str]:
    """The ISA levels this CPU runs, best first (empty: none; not x86-64 or no AVX2)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = _cpu_flags()
    return [name for name, _, needs in ISAS if needs <= have]


def library_path(isa: str, directory: Path = HERE) -> Path:
    """Where the build puts the library of one ISA level (``build.library_name``)."""
    _build.isa_flags(isa)  # ValueError for an unknown level
    return directory / _build.library_name(isa)


@dataclass(frozen=True)
class Library:
    """One loaded, bound library: ``lib`` (ctypes.CDLL, every kvkernels.h function
    declared), its ISA level, its file and the header's constants."""

    lib: ctypes.CDLL
    isa: str
    path: Path

    @classmethod
    def open(cls, path: Path, isa: str, check_sources: Path | None = None) -> Library:
        """Load and bind ``path``; RuntimeError with one line when it cannot be (missing,
        not loadable, struct sizes unlike the header's, or built from other sources than
        those in ``check_sources``)."""
        if not path.is_file():
            raise RuntimeError(f"native kernels: no {path.name} in {path.parent} (not built for this CPU: "
                               "pip install -e . or python -m kvserve.service.kernels builds them)")  # fmt: skip
        if check_sources is not None and (check_sources / _build.SOURCES[0]).is_file():
            built = (_build.build_id_of(path) or "").split(" ")[0]
            if built != _build.source_digest(isa, check_sources):
                raise RuntimeError(f"native kernels: {path.name} was built from other sources than {check_sources} "
                                   "(rebuild: pip install -e . or python -m kvserve.service.kernels)")  # fmt: skip
        try:
            lib = ctypes.CDLL(str(path))
            header_binding().declare(lib)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"native kernels: cannot load {path.name}: {str(e).splitlines()[0]}") from None
        return cls(lib, isa, path)

    @property
    def build_id(self) -> str:
        return self.lib.kv_build_id().decode().removeprefix("kvkernels-build:")


class _Loader:
    """The library this process serves with: opened once, on first use (``load``), or
    another level on request (``select``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.library: Library | None = None
        self.reason: str | None = None

    def best(self) -> Library:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"native kernels are x86-64 only (this is {platform.machine()})")
        isas = cpu_isas()
        if not isas:
            missing = sorted(ISAS[-1][2] - _cpu_flags())
            raise RuntimeError(f"native kernels need AVX2, FMA and F16C; this CPU lacks {', '.join(missing)}")
        first_error = None
        for isa in isas:  # the best level that was built (a build may lack one)
            try:
                return Library.open(library_path(isa), isa, check_sources=_build.SRC)
            except RuntimeError as e:
                first_error = first_error or e
        raise first_error

    def get(self) -> Library | None:
        with self.lock:
            if not self.tried:
                self.tried = True
                try:
                    self.library = self.best()
                except RuntimeError as e:
                    self.reason = str(e)
            return self.library


_LOADER = _Loader()  # the one process-wide handle on the shared library (a loaded .so cannot be unloaded)


def load() -> Library | None:
    """The library for the best ISA level this CPU runs, loaded on first call; None
    where there is none (``reason()``). Never compiles."""
    return _LOADER.get()


def select(isa: str) -> Library:
    """Serve with this ISA level's library instead of the best one (benchmarks and tests
    compare the levels); RuntimeError when this CPU lacks the level or it was not built."""
    if isa not in cpu_isas():
        raise RuntimeError(f"native kernels: this CPU does not run {isa} (it runs: {', '.join(cpu_isas()) or 'none'})")
    library = Library.open(library_path(isa), isa, check_sources=_build.SRC)
    with _LOADER.lock:
        _LOADER.tried, _LOADER.library, _LOADER.reason = True, library, None
    return library


def built_isas() -> list[str]:
    """The ISA levels whose library the build put beside this file."""
    return [isa for isa, _, _ in ISAS if library_path(isa).is_file()]


def isa() -> str | None:
    """The ISA level of the loaded library ("avx512" or "avx2"; None when unavailable)."""
    library = load()
    return library.isa if library is not None else None


def available() -> bool:
    return load() is not None


def reason() -> str | None:
    """One line saying why the kernels are unavailable (None when they are loaded)."""
    load()
    return _LOADER.reason
