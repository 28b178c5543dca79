"""Maps the repository's top-level folders to the installed ``kvserve.*`` names, and
builds the native kernels.

The repository keeps ``service/``, ``cachestore/``, ``clients/``, ``proto/`` and
``common/`` at its root; the distribution installs them as ``kvserve.service``,
``kvserve.cachestore``, ``kvserve.clients``, ``kvserve.proto`` (the .proto sources'
generated stubs, which the server and the clients both import) and ``kvserve.common``
(what the service and the cache store share: tier names, the circuit breaker, the
directory lock). ``kvserve`` is a namespace package, shared with the kvserve-client
distribution. Everything else is in pyproject.toml.

The native CPU kernels (service/kernels/) are plain C++ shared libraries loaded through
ctypes, one per ISA level: ``build_ext`` compiles them with the system C++ compiler
(service/kernels/build.py, which says why setuptools rather than CMake), into the wheel
or, for ``pip install -e .``, in place beside their sources. A host that cannot build
them (no compiler, not x86-64) still installs: torch's kernels serve there.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOTS = ("service", "cachestore", "clients", "proto", "common")
HERE = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("_kvkernels_build", HERE / "service" / "kernels" / "build.py")
kbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kbuild)


class KernelLibrary(Extension):
    """One ISA level's library (not a Python extension module: no Python API, no ABI tag)."""

    def __init__(self, isa: str) -> None:
        src = os.path.join("service", "kernels", "src")
        super().__init__(f"kvserve.service.kernels.{kbuild.library_name(isa)[:-3]}",
                         sources=[os.path.join(src, s) for s in kbuild.SOURCES], optional=True)  # fmt: skip
        self.isa = isa


class BuildExt(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        ext = self.ext_map.get(fullname)
        if isinstance(ext, KernelLibrary):
            return os.path.join(*fullname.split(".")[:-1], kbuild.library_name(ext.isa))
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, KernelLibrary):
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        inplace = self._inplace_file(ext)
        if inplace is not None and inplace.is_file() and kbuild.build_id_of(inplace) == self._build_id(ext.isa):
            out.parent.mkdir(parents=True, exist_ok=True)  # the library in the source tree is this build's: no compile
            out.write_bytes(inplace.read_bytes())
            return
        kbuild.build(out.parent, log=lambda line: print(line, flush=True), isas=(ext.isa,))

    def copy_extensions_to_source(self) -> None:
        """In place (editable installs), written aside and renamed: a process that has the
        old library loaded keeps its copy."""
        for ext in self.extensions:
            if not isinstance(ext, KernelLibrary):
                continue
            regular, inplace = Path(self.build_lib) / self.get_ext_filename(ext.name), self._inplace_file(ext)
            if not regular.is_file() or (inplace.is_file() and inplace.read_bytes() == regular.read_bytes()):
                continue
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=inplace.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(regular.read_bytes())
            os.chmod(tmp, 0o755)
            os.replace(tmp, inplace)
        if any(not isinstance(ext, KernelLibrary) for ext in self.extensions):
            super().copy_extensions_to_source()

    def _inplace_file(self, ext: Extension) -> Path | None:
        build_py = self.get_finalized_command("build_py")
        return Path(build_py.get_package_dir("kvserve.service.kernels")) / kbuild.library_name(ext.isa)

    def _build_id(self, isa: str) -> str | None:
        cc = kbuild.compiler()
        return None if cc is None else f"{kbuild.source_digest(isa)} {kbuild.compiler_id(cc)}"


packages = [f"kvserve.{root}" for root in ROOTS]
for root in ROOTS:
    packages += [f"kvserve.{root}.{sub}" for sub in find_packages(root, exclude=["node*"])]

setup(
    packages=packages,
    package_dir={f"kvserve.{root}": root for root in ROOTS},
    package_data={"kvserve.service": ["default_model/*", "kernels/src/*.cpp", "kernels/src/*.h"]},
    ext_modules=[KernelLibrary(isa) for isa, _, _ in kbuild.ISAS],
    cmdclass={"build_ext": BuildExt},
)
