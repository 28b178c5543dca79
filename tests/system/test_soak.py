"""The soak and fault bench in its short CI forms, against real processes. With Redis: 8
clients for 45 s with Redis restarted, Redis killed for 3 s, Redis frozen (SIGSTOP) for
3 s, a FLUSHALL with turns in flight, the server killed with SIGKILL, and a deploy while
Redis is frozen (SIGTERM, Redis resumed, the server started again). Without Redis: 4
clients for 24 s with the records directory unwritable for 3 s, a deploy and a SIGKILL.
Nothing is lost or corrupted: errors only while the server is down (or, without Redis,
while its records cannot be written: those turns are refused, never acknowledged), every
acknowledged turn in the server's transcript, greedy outputs equal to a cold server's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.redis_server import redis_server_binary
from tests.fixtures.serving import REPO, subprocess_env

pytestmark = pytest.mark.slow


def _soak(tmp_path, model_dir, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", *args, "--model", str(model_dir), "--json", str(out)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert out.exists(), proc.stdout + proc.stderr[-4000:]
    print(proc.stdout)
    return json.loads(out.read_text()), proc


def _nothing_lost(r: dict, proc: subprocess.CompletedProcess) -> None:
    assert r["unexpected_errors"] == 0
    assert set(r["errors"].get("none", {})) <= {"RESOURCE_EXHAUSTED"}, r["errors"]
    assert r["sessions_lost"] == 0 and r["transcript_mismatches"] == 0 and r["prompt_mismatches"] == 0
    assert r["acked_turns_lost"] == 0
    assert r["kept_mismatches"] == 0 and r["kept_checked"] > 0  # ended sessions read again at the end
    assert r["cold_mismatches"] == 0
    assert r["blocks_used_at_end"] == 0 and r["blocks_free_at_end"] == r["blocks_total"] > 0
    assert r["deploy_exit_codes"] == [0] and r["server_exit_code"] == 0
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def test_soak_with_faults_loses_nothing(tiny_llama_dir, tmp_path):
    if redis_server_binary() is None:
        pytest.skip("redis-server not installed (the soak kills and restarts its own)")
    r, proc = _soak(tmp_path, tiny_llama_dir, "--duration", "45", "--clients", "8", "--faults", "--redis-down", "3",
                    "--redis-freeze", "3", "--check-turns", "48")  # fmt: skip
    assert [w["kind"] for w in r["windows"]] == [
        "redis-restart", "redis-down", "redis-freeze", "redis-flushall", "server-kill", "deploy-redis-frozen"
    ]
    assert r["turns_ok"] > 20 and r["tokens"] > 0
    # errors only while the server was down (or explicit overload); Redis faults cost none
    assert set(r["errors"]) <= {"server-kill", "deploy-redis-frozen", "none"}, r["errors"]
    assert r["redis_fault_errors"] == 0
    _nothing_lost(r, proc)
    assert r["sessions_verified"] > 8 and r["cold_checked"] >= 24
    # the deploy left turns in the journal (Redis frozen through the drain), replayed by the next server
    journaled = [w for w in r["server_warnings"] if "stay in the session journal" in w]
    assert len(journaled) == 1 and any("from the journal" in w for w in r["server_warnings"])
    # the cache worked across tiers, and the pool is back at its baseline
    cached = r["cached_tokens_by_tier"]
    assert cached.get("device", 0) > 0 and cached.get("host", 0) + cached.get("disk", 0) + cached.get("redis", 0) > 0


def test_soak_without_redis_with_an_unwritable_records_directory_loses_nothing(tiny_llama_dir, tmp_path):
    r, proc = _soak(tmp_path, tiny_llama_dir, "--store", "disk", "--duration", "24", "--clients", "4", "--faults",
                    "--unwritable", "3", "--check-turns", "16")  # fmt: skip
    assert [w["kind"] for w in r["windows"]] == ["records-unwritable", "server-deploy", "server-kill"]
    assert r["turns_ok"] > 10
    assert set(r["errors"]) <= {"records-unwritable", "server-deploy", "server-kill", "none"}, r["errors"]
    assert set(r["errors"].get("records-unwritable", {})) == {"UNAVAILABLE"}, r["errors"]  # refused, never acknowledged
    _nothing_lost(r, proc)
    assert r["sessions_verified"] > 4
