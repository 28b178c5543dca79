"""The first hour: every startup failure of ``kvserve serve`` is one line on stderr
(what, where, what to do) and a non-zero exit, never a traceback unless
``--log-level debug``; the port, the device and Redis are checked before the model
loads; an unreachable Redis serves degraded unless ``--redis-required``."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.service.cli import main
from kvserve.service.server import StartupError, check_port
from tests.fixtures.serving import REPO, ServerThread, subprocess_env, tiny_config

_SERVE = ["serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--log-level", "warning"]


def _fails_with_one_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    status = main([*_SERVE, *args], environ={})
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("kvserve serve: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def test_missing_model_directory(capsys, tmp_path: Path) -> None:
    line = _fails_with_one_line(capsys, "--model", str(tmp_path / "nope"))
    assert "nope: model directory or GGUF file does not exist" in line and "--model" in line


def test_model_path_is_a_file(capsys, model_copy: Path) -> None:
    line = _fails_with_one_line(capsys, "--model", str(model_copy / "config.json"))
    assert "config.json: is a file, not a model directory or a GGUF file" in line


def test_bad_config_json(capsys, model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    line = _fails_with_one_line(capsys, "--model", str(model_copy))
    assert "config.json: cannot parse JSON" in line


def test_unsupported_rope_type(capsys, model_copy: Path) -> None:
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    line = _fails_with_one_line(capsys, "--model", str(model_copy))
    assert "unsupported rope_scaling type 'yarn'" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, model_copy: Path) -> None:
    line = _fails_with_one_line(capsys, "--model", str(model_copy), "--device", "cuda")
    assert "--device cuda: CUDA is not available" in line and "--device cpu" in line


def test_port_in_use_is_found_before_the_model_loads(capsys, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # The model directory does not exist: the port error wins, so it was checked first.
        line = _fails_with_one_line(capsys, "--model", str(tmp_path / "nope"), "--port", str(port))
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line
    with pytest.raises(StartupError, match="not an address of this machine"):
        check_port("192.0.2.1", 50051)  # TEST-NET-1: never local


def test_kv_events_without_pyzmq_is_one_line_before_the_model_loads(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # pyzmq not installed (the events extra)
    # The model directory does not exist: the events error wins, so it was checked first.
    line = _fails_with_one_line(capsys, "--model", str(tmp_path / "nope"), "--kv-events-endpoint", "tcp://127.0.0.1:*")
    assert "--kv-events-endpoint" in line and "pyzmq" in line and "kvserve[events]" in line


def test_redis_required_refuses_to_start(capsys, model_copy: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
    line = _fails_with_one_line(capsys, "--model", str(model_copy), "--redis-url", url, "--redis-required")
    assert f"Redis at {url} (--redis-url) does not answer" in line and "--redis-required" in line


def test_unreachable_redis_serves_degraded_and_says_so(caplog, tiny_llama_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
    with caplog.at_level(logging.WARNING, logger="kvserve.service.server"):
        with ServerThread(tiny_config(tiny_llama_dir, redis_url=url, host_cache_memory=0)) as server:
            assert server.running is not None and server.running.port > 0
    degraded = [r.getMessage() for r in caplog.records if "serving DEGRADED" in r.getMessage()]
    assert len(degraded) == 1 and url in degraded[0]


def test_debug_log_level_shows_the_traceback(caplog, tmp_path: Path) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvserve.service.cli"):
        status = main([*_SERVE, "--log-level", "debug", "--model", str(tmp_path / "nope")], environ={})
    assert status == 2
    assert any(r.exc_info and "startup failed" in r.getMessage() for r in caplog.records)


def test_a_real_process_prints_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.service", "--model", str(tmp_path / "nope"), "--port", "0", "--log-level", "warning"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"kvserve serve: error: cannot load the model: {tmp_path / 'nope'}: model directory or GGUF file does not "
        "exist; --model (KVSERVE_MODEL) takes a Hugging Face model directory (config.json, *.safetensors, tokenizer) "
        "or a GGUF file of a supported family, or a model name (smollm2)"
    ]


_OPENMP_PROBE = """
import os, sys
from kvserve.service import cli
from kvserve.service import kernels
seen = []
passive = kernels.passive_openmp
kernels.passive_openmp = lambda environ=os.environ: (seen.append("torch" in sys.modules), passive(environ))
status = cli.main(["serve", "--model", sys.argv[1], "--port", "0", "--log-level", "warning"])
print(status, os.environ.get("OMP_WAIT_POLICY"), seen)
"""


@pytest.mark.parametrize("preset,expect", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_serve_asks_openmp_to_wait_passively_before_torch_loads(tmp_path: Path, preset, expect) -> None:
    """torch's idle OpenMP threads spinning would take the cores the native kernels' own
    threads need: ``serve`` sets OMP_WAIT_POLICY=PASSIVE before torch is imported (libgomp
    reads it once, when it loads); a value the user set wins."""
    env = subprocess_env()
    env.pop("OMP_WAIT_POLICY", None)
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", _OPENMP_PROBE, str(tmp_path / "nope")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.stdout.split() == ["2", expect, "[False]"], out.stderr
