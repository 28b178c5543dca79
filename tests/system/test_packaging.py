"""The server distribution installs under one unambiguous name: ``kvserve.service``,
``kvserve.cachestore``, ``kvserve.clients``, ``kvserve.proto`` and ``kvserve.common`` (a
namespace shared with kvserve-client), nothing generic at the top of a user's
site-packages; the console scripts, the packaged
default model and the native kernels, built by the install (one library per ISA level),
come along: a fresh install serves with them at once, never compiling at start."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.serving import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=out,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (whl,) = out.glob("kvserve-*.whl")
    return whl


def test_the_wheel_holds_only_the_kvserve_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvserve", next(t for t in tops if t.endswith(".dist-info"))}
    assert "kvserve/__init__.py" not in names  # a namespace: kvserve-client adds kvserve/clients beside it
    assert not [n for n in names if "/_proto/" in n]  # the stubs are kvserve.proto's, imported by both sides
    for path in ("kvserve/service/cli.py", "kvserve/service/engine/engine.py", "kvserve/service/models/llama.py",
                 "kvserve/service/default_model/model.safetensors", "kvserve/cachestore/tiered.py",
                 "kvserve/clients/client.py", "kvserve/proto/kvserve/v1/generation_pb2_grpc.py",
                 "kvserve/common/breaker.py", "kvserve/common/tiers.py"):
        assert path in names, path
    from kvserve.service.kernels import ISAS, build

    for source in (*build.SOURCES, *build.HEADERS):  # shipped: the loader checks the libraries against them
        assert f"kvserve/service/kernels/src/{source}" in names, source
    for isa, _, _ in ISAS:  # built by the wheel's build (x86-64 with a compiler), never at start
        assert f"kvserve/service/kernels/{build.library_name(isa)}" in names, isa
    assert not [n for n in names if "/node/" in n or "/tests/" in n]
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "kvserve = kvserve.service.cli:main" in entry_points
    assert "kvserve-chat = kvserve.clients.chat:main" in entry_points


def test_installed_in_a_fresh_venv_the_names_resolve_there(wheel, tmp_path):
    """A venv that sees this interpreter's packages (torch and the rest) but installs the
    wheel itself: every kvserve name resolves inside the venv, none at the top level."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=True)
    py = env_dir / "bin" / "python"
    # --ignore-installed: this interpreter's own kvserve (an editable checkout) is visible
    # through the system site-packages, and pip would otherwise call it satisfied
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                              "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [py, "-c", "import importlib.util as u\n"
                   "import kvserve.service.cli, kvserve.cachestore.tiered, kvserve.clients.client as c\n"
                   "import kvserve.proto.kvserve.v1.generation_pb2 as pb\n"
                   "from kvserve.service.engine.config import DEFAULT_MODEL_DIR\n"
                   "print(kvserve.service.cli.__file__, kvserve.cachestore.tiered.__file__, c.__file__, pb.__file__)\n"
                   "print((DEFAULT_MODEL_DIR / 'model.safetensors').is_file())"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    files, has_model = probe.stdout.split("\n")[:2]
    assert all(f.startswith(str(env_dir)) for f in files.split()), files
    assert has_model == "True"
    script = (env_dir / "bin" / "kvserve").read_text()
    assert "from kvserve.service.cli import main" in script


FAKE_COMPILER = """#!/bin/sh
echo "$0 $*" >> {log}
exit 1
"""


def test_a_fresh_editable_install_serves_with_the_kernels_and_compiles_nothing_at_start(tmp_path):
    """The README's first command in a fresh venv: ``pip install -e .`` (torch is this
    interpreter's, seen through the system site-packages), then ``kvserve serve``. The
    install built the kernels; the server logs them active and starts serving with every
    C++ compiler on its PATH a fake that records being called: none is, and opening the
    kernels takes well under a second (it took a 12-42 s compile before). The whole
    start's time is printed, not asserted: on a shared host torch's import alone moves
    from 2 to 12 s with the load."""
    import signal
    import threading
    import time

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                              "--no-build-isolation", "--ignore-installed", "-e", str(REPO)],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert install.returncode == 0, install.stderr
    fake_bin, log = tmp_path / "fake-bin", tmp_path / "compiler-calls.log"
    fake_bin.mkdir()
    for cc in ("c++", "g++", "clang++", "cc", "gcc"):
        (fake_bin / cc).write_text(FAKE_COMPILER.format(log=log))
        (fake_bin / cc).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{fake_bin}:{env_dir / 'bin'}:/usr/bin:/bin", CXX=str(fake_bin / "c++"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen([str(env_dir / "bin" / "kvserve"), "serve", "--port", "0", "--host", "127.0.0.1"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[str] = []
    serving = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "serving kvserve.v1.GenerationService" in line:
                serving.set()
        serving.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        serving.wait(180)
        wall = time.monotonic() - started
        assert any("serving kvserve.v1.GenerationService" in line for line in lines), "".join(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
    text = "".join(lines)
    assert "decode products by the native CPU kernels" in text, text
    # (through kvserve/'s links when run in the checkout: the file itself is this checkout's)
    found = Path(probe_file(py, env)).resolve()
    assert found.is_relative_to((REPO / "service").resolve()), f"the venv does not run this checkout: {found}"
    assert not log.exists(), log.read_text()  # no compiler ran
    cpu = usage.ru_utime + usage.ru_stime  # os.wait4: the server's and every child's it waited for
    print(f"kvserve serve: serving after {wall:.1f} s wall, {cpu:.1f} s CPU (start and drain)")
    timed = subprocess.run([str(py), "-c", "import time\nfrom kvserve.service import kernels\nt = time.perf_counter()\n"
                            "assert kernels.available(), kernels.reason()\nprint(time.perf_counter() - t)"],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert timed.returncode == 0, timed.stderr
    assert float(timed.stdout) < 1.0 and not log.exists()


def probe_file(py: Path, env: dict[str, str]) -> str:
    """Where the venv's interpreter finds ``kvserve.service.kernels``."""
    out = subprocess.run([str(py), "-c", "import kvserve.service.kernels as k; print(k.__file__)"],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    return out.stdout.strip()


def _migrate():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import migrate_imports
    finally:
        sys.path.pop(0)
    return migrate_imports


def test_migrate_imports_rewrites_the_old_names_once():
    old = ("from service.engine import AsyncEngine\n"
           "    import cachestore.codec as codec\n"
           "from clients import KVServeClient\n"
           "cmd = [sys.executable, '-m', 'kvserve.service', '--port', '0']\n"
           "log = 'python -m kvserve.clients.chat'\n"
           "caplog.at_level(10, logger='kvserve.service.server')\n"
           "attrs = {'service.name': 'x'}  # OpenTelemetry's, not ours\n"
           "import services_of_mine\n")  # fmt: skip
    new = _migrate().migrate(old)
    assert new == ("from kvserve.service.engine import AsyncEngine\n"
                   "    import kvserve.cachestore.codec as codec\n"
                   "from kvserve.clients import KVServeClient\n"
                   "cmd = [sys.executable, '-m', 'kvserve.service', '--port', '0']\n"
                   "log = 'python -m kvserve.clients.chat'\n"
                   "caplog.at_level(10, logger='kvserve.service.server')\n"
                   "attrs = {'service.name': 'x'}  # OpenTelemetry's, not ours\n"
                   "import services_of_mine\n")  # fmt: skip
    assert _migrate().migrate(new) == new


def test_no_code_in_the_repository_uses_the_old_import_names():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    migrate = _migrate().migrate
    stale = [p for p in tracked if (REPO / p).exists() and migrate((REPO / p).read_text()) != (REPO / p).read_text()]
    assert not stale, f"old import names (run python tools/migrate_imports.py): {stale}"
