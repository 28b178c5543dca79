"""The device check (bench/gpu_check.sh, bench/gpu_check.py) dry-run on the CPU at tiny sizes,
so the script a GPU session runs in its few minutes of lease cannot rot: every step runs,
each figure lands in figures.jsonl beside its limit, and the summary prints them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], tmp_path: Path, timeout: int, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **env)
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


def _figures(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()]


def test_the_device_check_runs_in_pieces_through_its_script(tmp_path) -> None:
    """``STEPS=limits,summary bench/gpu_check.sh --cpu``: the environment, the limits
    (written for the later steps) and the summary table; the steps not named do not run;
    exit status 0. (What each step measures is the next test's: it runs them all.)"""
    done = _run(["bash", "bench/gpu_check.sh", "--cpu"], tmp_path, 600, STEPS="limits,summary")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "out" / "gpu_check.txt").read_text()
    for name in ("environment", "limits", "summary"):
        assert f"--- {name}: ok" in report, report[-3000:]
    assert "=== graphs" not in report and "=== decode" not in report and "=== 0 step(s) failed" in report
    assert "| figure | value | limit | of limit | goal | met |" in report
    limits = json.loads((tmp_path / "out" / "limits.json").read_text())
    assert limits["d2d_gbps"] > 0 and limits["h2d_gbps"] > 0 and limits["matmul_tflops"] > 0


@pytest.mark.slow
def test_every_step_of_the_device_check_runs_on_the_cpu(tmp_path) -> None:
    """``gpu_check.py all --device cpu --quick``: every step, every figure the issue names
    with its limit where it has one (the graphs' replay equal to eager for every family),
    and the summary."""
    done = _run([sys.executable, "bench/gpu_check.py", "all", "--device", "cpu", "--quick", "--out",
                 str(tmp_path / "out"), "--work", str(tmp_path / "work")], tmp_path, 1500)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = [f["figure"] for f in _figures(tmp_path / "out")]
    for want in ("parity llama-gqa float32", "parity gpt2 bfloat16", "graphs tiny_llama float32 exact",
                 "sessions restored = cold, float32", "decode, one stream", "decode, batch 4", "prefill 64",
                 "host-tier restore 128", "returning turn 128 from the host tier",
                 "Redis restore 128, 4 readers, io-threads 1", "Redis restore 128, 4 readers, io-threads 4",
                 "int8 Redis restore 128, io-threads 4", "fp8 Redis restore 128, io-threads 1", "speculative rewrite",
                 "speculative summary"):
        assert want in names, (want, names)
    figs = {f["figure"]: f for f in _figures(tmp_path / "out")}
    assert figs["decode, one stream"]["limit_name"] == "weight-read limit" and figs["decode, one stream"]["limit"] > 0
    assert figs["host-tier restore 128"]["limit_name"] == "pinned H2D"
    assert figs["sessions restored = cold, float32"]["value"] == 0
    assert "| figure | value | limit | of limit | goal | met |" in done.stdout
    # the graph runner's replay equals eager per family (the CUDA step's code over torch's kernels)
    graphs = [f for f in figs.values() if f["figure"].startswith("graphs ")]
    assert {f["figure"].split()[1] for f in graphs} == {"tiny_llama", "gemma2", "gemma3", "phi4-mini"}
    assert all(f["ok"] and f["value"] == 0 for f in graphs)
    assert "| graphs gemma3 float32 exact | 0 max diff" in done.stdout
