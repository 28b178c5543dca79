"""The kvserve-client distribution (clients/pyproject.toml) installs into a fresh venv
without torch and talks to a live server from there.

The venv is plain (no system site-packages: that would bring torch); grpcio, protobuf
and grpcio-health-checking come from this interpreter's installed copies through a
.pth directory holding only them, so pip resolves the dependencies offline
(``--no-index``) and nothing else is visible."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.fixtures.serving import REPO, ServerThread, tiny_config

# what the client package needs (and their own requirements, found from the metadata),
# plus setuptools to build it (a recent one: it builds wheels itself)
ROOTS = ("grpcio", "grpcio-health-checking", "protobuf", "setuptools")


def _closure(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[key] = dist
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link_distribution(dist: importlib.metadata.Distribution, into: Path) -> None:
    """Symlink a distribution's top-level modules and its dist-info into ``into``."""
    for f in dist.files or ():
        top = f.parts[0]
        if top == ".." or top.endswith(".pth") or top == "__pycache__":
            continue
        src = Path(dist.locate_file(top))
        dst = into / top
        if src.exists() and not dst.exists():
            dst.symlink_to(src)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("client_venv")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    deps = root / "deps"
    deps.mkdir()
    for dist in _closure(ROOTS):
        _link_distribution(dist, deps)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "kvserve_test_deps.pth").write_text(str(deps) + "\n")
    # the venv's bundled setuptools would shadow the .pth one and cannot build a wheel alone
    subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "setuptools"], check=True, capture_output=True)
    out = subprocess.run(
        [py, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--disable-pip-version-check", "-q",
         str(REPO / "clients")],
        capture_output=True, text=True, cwd=root, env=_clean_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return env_dir


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_NO_CACHE_DIR"] = "1"
    return env


def test_the_client_package_installs_without_torch_and_calls_a_live_server(client_venv, tiny_llama_dir, tmp_path):
    py = client_venv / "bin" / "python"
    probe = subprocess.run(
        [py, "-c", "import importlib.util as u, importlib.metadata as m, kvserve.clients as clients\n"
                   "import kvserve.proto.kvserve.v1.generation_pb2_grpc as stubs\n"
                   "print(u.find_spec('torch'), u.find_spec('kvserve.service'), clients.__file__, stubs.__file__)\n"
                   "print([n for n in ('service', 'clients', 'cachestore', 'proto') if u.find_spec(n)])\n"
                   "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"],
        capture_output=True, text=True, cwd=tmp_path, env=_clean_env(),
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    first, generic, dists = probe.stdout.splitlines()[:3]
    assert first.startswith("None None ")  # no torch, no server
    assert all(f.startswith(str(client_venv)) for f in first.split()[2:]), first  # the installed clients and stubs
    assert "torch" not in dists and "kvserve-client" in dists
    assert generic == "[]"  # no generic top-level names in the user's site-packages
    with ServerThread(tiny_config(tiny_llama_dir)) as s:
        call = subprocess.run(
            [py, "-c", "import sys\nfrom kvserve.clients import KVServeClient\n"
                       "with KVServeClient(sys.argv[1], timeout=60) as c:\n"
                       "    r = c.complete(text='hello there', max_new_tokens=5, ignore_eos=True)\n"
                       "    print(r.usage.completion_tokens if hasattr(r, 'usage') else len(r.token_ids))\n",
             s.address],
            capture_output=True, text=True, cwd=tmp_path, env=_clean_env(), timeout=120,
        )  # fmt: skip
        assert call.returncode == 0, call.stderr
        assert call.stdout.strip() == "5"
        chat = subprocess.run(
            [client_venv / "bin" / "kvserve-chat", "--address", s.address],
            input="hello\n/quit\n", capture_output=True, text=True, cwd=tmp_path, env=_clean_env(), timeout=120,
        )  # fmt: skip
        assert chat.returncode == 0, chat.stderr
        assert "cached" in chat.stdout + chat.stderr
