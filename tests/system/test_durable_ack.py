"""Nothing acknowledged is lost across a deploy or a crash (issue 45), against subprocess
servers, real redis-server processes and real files:

* Redis hung (SIGSTOP) while sessions take turns, then the server stopped (SIGTERM: a
  deploy; or SIGKILL) and started again: with ``--disk-cache-dir`` every acknowledged turn
  is there (the session journal), at once while Redis still hangs and in Redis once it
  answers;
* a journal that cannot be written (the server's file size limit) fails the turn
  (UNAVAILABLE) rather than acknowledge it;
* without a disk directory a drain that Redis does not answer says in one line how many
  sessions and turns are lost and exits 3.

The in-process forms (Redis answering during the drain, the disk session store's
unwritable records directory): tests/service/test_durable_sessions.py."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import redis

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.sessions import decode_record
from tests.fixtures.serving import start_server_process, wait_until

pytestmark = pytest.mark.slow

SESSIONS = ("s0", "s1", "s2")


def _args(model_dir: Path, *, redis_url: str | None = None, disk: Path | None = None, drain: str = "10s",
          extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--block-size", "8",
            "--kv-cache-memory", "1MiB", "--drain-timeout", drain, "--log-level", "info", *extra]  # fmt: skip
    if redis_url:
        args += ["--redis-url", redis_url, "--spill-after", "1h"]
    if disk:
        args += ["--disk-cache-dir", str(disk)]
    return args


def _turns(port: int, acked: dict[str, list[int]], messages: list[str]) -> None:
    """Each session takes the turns; ``acked`` gets its transcript after each acknowledged one."""
    with KVServeClient(f"127.0.0.1:{port}", timeout=20) as c:
        for text in messages:
            for sid in SESSIONS:
                c.chat(sid, text, max_new_tokens=4)
                acked[sid] = c.get_session(sid, include_token_ids=True).token_ids


def _check(port: int, acked: dict[str, list[int]], turns: int) -> None:
    with KVServeClient(f"127.0.0.1:{port}", timeout=20) as c:
        for sid in SESSIONS:
            info = c.get_session(sid, include_token_ids=True)
            assert (info.turns, info.token_ids) == (turns, acked[sid]), sid


def _stop(proc: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    return proc.wait(120)


def _in_redis(url: str, sid: str) -> int:
    """The turns of the session's record in Redis (-1: none)."""
    with redis.Redis.from_url(url) as r:
        raw = r.get(f"kvserve:sess::{sid}")
    return decode_record(raw).turns if raw and raw.startswith(b"KVSS") else -1


def _lines(log: list[str], text: str) -> list[str]:
    return [line for line in log if text in line]


def test_a_deploy_and_a_crash_while_redis_hangs_lose_no_acknowledged_turn(tiny_llama_dir, make_redis_server, tmp_path):
    """The issue's attack, small: sessions take a turn, Redis is SIGSTOPped, they take two
    more (acknowledged from this replica's copy), SIGTERM (a deploy): the drain waits for
    Redis, leaves them in the journal and exits 0. The server starts again with Redis still hung, serves every
    acknowledged turn from the journal and takes one more each; a turn it cannot journal
    (its file size limit set to 0 from outside, as a full disk would refuse) fails
    UNAVAILABLE, its session as before it. SIGKILL; started again (Redis still hung): all
    there; SIGCONT: Redis gets every acknowledged transcript."""
    rds = make_redis_server()
    args = _args(tiny_llama_dir, redis_url=rds.url, disk=tmp_path / "disk", drain="2s")
    acked: dict[str, list[int]] = {}
    proc, port, log = start_server_process(args)
    try:
        _turns(port, acked, ["hello there"])
        rds._proc.send_signal(signal.SIGSTOP)
        _turns(port, acked, ["tell me more", "and then?"])
        assert _stop(proc) == 0  # after waiting 2 s for Redis
        said = _lines(log, "drain: 3 session(s) with 6 acknowledged turn(s) not yet in Redis")
        assert len(said) == 1 and "stay in the session journal" in said[0]

        proc, port, log = start_server_process(args)  # Redis still hung: served degraded, from the journal
        assert _lines(log, "3 session(s) from the journal") and _lines(log, "6 acknowledged turn(s)")
        _check(port, acked, 3)
        _turns(port, acked, ["one more while Redis hangs"])
        subprocess.run(["prlimit", f"--pid={proc.pid}", "--fsize=0:unlimited"], check=True)
        with KVServeClient(f"127.0.0.1:{port}", timeout=20) as c:
            with pytest.raises(KVServeError) as err:
                c.chat("s0", "this one cannot be saved", max_new_tokens=4)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "nothing was recorded" in err.value.details
            assert c.get_session("s0", include_token_ids=True).token_ids == acked["s0"]
        subprocess.run(["prlimit", f"--pid={proc.pid}", "--fsize=unlimited:unlimited"], check=True)
        assert _stop(proc, signal.SIGKILL) == -signal.SIGKILL

        proc, port, log = start_server_process(args)
        _check(port, acked, 4)
        rds._proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: all(_in_redis(rds.url, sid) == 4 for sid in SESSIONS), timeout=30, interval=0.2)
        _check(port, acked, 4)
        assert _stop(proc) == 0
    finally:
        rds._proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    with redis.Redis.from_url(rds.url) as r:  # the written-back records are the acknowledged transcripts
        for sid in SESSIONS:
            assert decode_record(r.get(f"kvserve:sess::{sid}")).token_ids == acked[sid]
    assert not (tmp_path / "disk" / "journal" / "sessions.kvsj").stat().st_size  # nothing pending any more


def test_without_a_disk_directory_a_drain_redis_does_not_answer_says_what_is_lost_and_exits_3(
    tiny_llama_dir, make_redis_server
):
    """No journal: a SIGTERM while Redis hangs waits for it up to the drain timeout, then
    says in one error line how many sessions and acknowledged turns are lost, and exits 3.
    (Redis answering during the drain: tests/service/test_durable_sessions.py.)"""
    rds = make_redis_server()
    acked: dict[str, list[int]] = {}
    proc, port, log = start_server_process(_args(tiny_llama_dir, redis_url=rds.url, drain="2s"))
    try:
        _turns(port, acked, ["hello there"])
        rds._proc.send_signal(signal.SIGSTOP)
        _turns(port, acked, ["and then?"])
        t0 = time.monotonic()
        assert _stop(proc) == 3
        assert time.monotonic() - t0 >= 2.0
    finally:
        rds._proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in log if " ERROR " in line]
    assert len(errors) == 1, errors
    assert "drain: 3 session(s) with 3 acknowledged turn(s) not in Redis after" in errors[0]
    assert "--disk-cache-dir" in errors[0]
