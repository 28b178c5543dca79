"""A response whose server died in its first turn is not a response: ``python -m
kvserve.service`` in a subprocess is SIGKILLed while it streams a response, leaving the
response's placeholder session record (and, with Redis, its turn lock) behind.

- With Redis: another replica sharing it, started before the kill, answers a follow-up
  409 while the dead replica's turn lock lasts (it cannot tell a dead replica from a busy
  one) and ``GET`` ``in_progress``; once the lock's lease lapses (``--session-lock-ttl``)
  the response is removed on the next read: ``GET`` 404, a follow-up 404
  ``previous_response_not_found`` (never a turn from an empty transcript), and its
  record is gone from Redis.
- With the disk session store (``--disk-cache-dir``, no Redis): the restarted server
  finds the record with no lock (locks live in the process), so the first read removes it.
"""

from __future__ import annotations

import re
import signal
import time

import openai
import pytest

from tests.fixtures.models import make_tiny_llama
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import ServerThread, start_server_process, tiny_config, wait_until

pytestmark = pytest.mark.slow
LOCK_TTL = 8.0  # seconds: the dead replica's lock lasts this long after its last renewal
_HTTP_RE = re.compile(r"OpenAI-compatible HTTP on :(\d+)")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_abandoned"), max_position_embeddings=4096)


def _start(model_dir, *extra: str):
    proc, _port, lines = start_server_process([
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--http-port", str(free_port()),
        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--block-size", "8",
        "--log-level", "info", "--speculative", "off", *extra,
    ])  # fmt: skip
    http = next(int(m.group(1)) for line in lines if (m := _HTTP_RE.search(line)))
    return proc, http


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)


def _kill_mid_stream(proc, port: int, model: str) -> str:
    """Start a long streamed response, SIGKILL the server after its first text; its id."""
    with _client(port) as c:
        with c.responses.create(model=model, input="tell me a very long story", stream=True, max_output_tokens=3000,
                                temperature=0, extra_body={"ignore_eos": True}) as events:  # fmt: skip
            rid = None
            for ev in events:
                if ev.type == "response.created":
                    rid = ev.response.id
                if ev.type == "response.output_text.delta" and ev.delta:
                    proc.send_signal(signal.SIGKILL)
                    break
    assert proc.wait(30) == -signal.SIGKILL and rid is not None
    return rid


def _status(c: openai.OpenAI, rid: str) -> str:
    try:
        return c.responses.retrieve(rid).status
    except openai.NotFoundError:
        return "not found"


def test_a_response_abandoned_by_a_killed_replica_is_reaped_when_its_lock_lapses(long_model, redis_url):
    model = str(long_model)
    cfg = tiny_config(long_model, redis_url=redis_url, host_cache_memory=0, spill_after=3600.0, session_lock_ttl=LOCK_TTL)
    with ServerThread(cfg, http_port=0) as other, _client(other.running.http_port) as c:
        proc, port = _start(long_model, "--redis-url", redis_url, "--session-lock-ttl", f"{LOCK_TTL:g}")
        try:
            killed_at = None
            rid = _kill_mid_stream(proc, port, model)
            killed_at = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
        # the dead replica's lock is still in Redis: in progress, as far as anyone can tell
        assert _status(c, rid) == "in_progress"
        with pytest.raises(openai.ConflictError) as e:
            c.responses.create(model=model, input="and then?", previous_response_id=rid, max_output_tokens=2)
        assert e.value.body["code"] == "response_in_progress"
        assert time.monotonic() - killed_at < LOCK_TTL  # (those two reads ran while the lock lasted)
        # its lease lapses: the next read removes the placeholder
        assert wait_until(lambda: _status(c, rid) == "not found", timeout=LOCK_TTL + 30, interval=0.5)
        assert time.monotonic() - killed_at >= LOCK_TTL - 1.5  # not before the lock's lease ran out
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=model, input="and then?", previous_response_id=rid, max_output_tokens=2)
        assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
        assert other.call(other.running.sessions.store.get("", rid)) is None
        assert rid not in [r.session_id for r in other.call(other.running.sessions.store.list("", 100, ""))[0]]
    assert other.running.sessions.records_lost == 0


def test_a_response_abandoned_on_the_disk_session_store_is_reaped_at_the_first_read(long_model, tmp_path):
    model = str(long_model)
    disk = str(tmp_path / "disk")
    proc, port = _start(long_model, "--disk-cache-dir", disk)
    try:
        rid = _kill_mid_stream(proc, port, model)
    finally:
        if proc.poll() is None:
            proc.kill()
    with ServerThread(tiny_config(long_model, disk_cache_dir=disk, redis_url=None), http_port=0) as s, \
            _client(s.running.http_port) as c:  # fmt: skip
        assert s.call(s.running.sessions.store.get("", rid)) is not None  # the placeholder, read back from its file
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model=model, input="and then?", previous_response_id=rid, max_output_tokens=2)
        assert e.value.body["code"] == "previous_response_not_found"
        assert s.call(s.running.sessions.store.get("", rid)) is None
        assert _status(c, rid) == "not found"
