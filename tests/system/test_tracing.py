"""OpenTelemetry traces through live servers (service/tracing.py), captured with the
SDK's in-memory exporter: the caller's ``traceparent`` metadata parents one server span
per Generate call, whose children are its phases (prepare, queue, restore with blocks
and bytes per tier, prefill, decode, commit); a failed call's span carries its status; tracing is off
unless the OTEL_* environment turns it on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvserve.clients import KVServeClient, build_request
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.service.tracing import Tracing
from tests.fixtures.serving import BLOCK_SIZE, REPO, ServerThread, subprocess_env, tiny_config, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SERVER_SPAN = "kvserve.v1.GenerationService/Generate"


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


def generate(address: str, metadata=(), **request):
    """A raw Generate call with extra metadata; returns (responses, error or None)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        out = []
        try:
            for resp in stub.Generate(build_request(**request), metadata=tuple(metadata), timeout=60):
                out.append(resp)
        except grpc.RpcError as e:
            return out, e
    return out, None


def spans_of(exporter, trace_id: int):
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def test_a_restored_turn_is_one_server_span_under_the_callers_trace_with_phase_children(
    tiny_llama_dir, redis_url, tracing, exporter
):
    cfg = dict(redis_url=redis_url, host_cache_memory=0, spill_after=0.05, spill_to=("redis",), restore_policy="always")
    with ServerThread(tiny_config(tiny_llama_dir, **cfg), tracing=tracing) as a, \
            ServerThread(tiny_config(tiny_llama_dir, **cfg), tracing=tracing) as b:  # fmt: skip
        with KVServeClient(a.address, timeout=60) as ca:
            ca.chat("traced", "hello there, tell me a story about a fox and a dog", max_new_tokens=6)
            assert wait_until(lambda: (s := ca.get_session("traced")).cached_blocks.get("redis", 0) == s.full_blocks > 0)
            info = ca.model_info()
        exporter.clear()
        # Turn 2 on replica B: its prefix comes from Redis.
        responses, error = generate(
            b.address, [("traceparent", TRACEPARENT)], session_id="traced", require_existing_session=True,
            messages=[{"role": "user", "content": "and then?"}], max_new_tokens=5, ignore_eos=True,
        )  # fmt: skip
        assert error is None
    start = responses[0].start
    redis_tokens = start.cached_by_tier.redis
    assert redis_tokens > 0

    spans = spans_of(exporter, int(TRACE_ID, 16))
    (server,) = [s for s in spans if s.name == SERVER_SPAN]
    assert server.kind == SpanKind.SERVER
    assert server.parent is not None and server.parent.span_id == int(PARENT_ID, 16) and server.parent.is_remote
    attrs = server.attributes
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "Generate"
    assert attrs["rpc.grpc.status_code"] == "OK" and server.status.status_code != StatusCode.ERROR
    assert attrs["kvserve.session_id"] == "traced" and attrs["kvserve.request_id"] == start.request_id
    assert attrs["kvserve.prompt_tokens"] == start.prompt_tokens
    assert attrs["kvserve.cached_tokens"] == start.cached_tokens and attrs["kvserve.cached_tokens.redis"] == redis_tokens
    assert attrs["kvserve.completion_tokens"] == 5

    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id}
    phases = ("prepare", "queue", "restore", "prefill", "decode", "commit")
    assert set(children) == {f"kvserve.{p}" for p in phases}
    restore = children["kvserve.restore"].attributes
    assert restore["kvserve.restore.redis.blocks"] == redis_tokens // BLOCK_SIZE
    assert restore["kvserve.restore.redis.bytes"] == redis_tokens * info.bytes_per_token
    assert "kvserve.restore.host.blocks" not in restore
    assert children["kvserve.prefill"].attributes["kvserve.prefill_tokens"] == start.prompt_tokens - start.cached_tokens
    assert children["kvserve.decode"].attributes["kvserve.decode_tokens"] == 4
    # The phases follow one another inside the call's span.
    order = [children[f"kvserve.{p}"] for p in phases]
    assert server.start_time <= order[0].start_time
    for before, after in zip(order, order[1:]):
        assert before.start_time <= before.end_time <= after.start_time
    assert order[-1].end_time <= server.end_time


def test_without_traceparent_a_call_starts_its_own_trace_and_a_failed_call_records_its_status(
    tiny_llama_dir, tracing, exporter
):
    with ServerThread(tiny_config(tiny_llama_dir), tracing=tracing) as server:
        _, error = generate(server.address, text="a prompt", max_new_tokens=3)
        assert error is None
        _, error = generate(server.address, [("traceparent", TRACEPARENT)], session_id="nobody",
                            require_existing_session=True, text="hello")  # fmt: skip
        assert error is not None and error.code() == grpc.StatusCode.NOT_FOUND
    roots = [s for s in exporter.get_finished_spans() if s.name == SERVER_SPAN and s.parent is None]
    assert len(roots) == 1 and roots[0].context.trace_id != int(TRACE_ID, 16)
    (failed,) = [s for s in spans_of(exporter, int(TRACE_ID, 16)) if s.name == SERVER_SPAN]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["rpc.grpc.status_code"] == "NOT_FOUND" and "NOT_FOUND" in failed.status.description
    # It never reached the engine: no phase spans under it.
    assert [s for s in spans_of(exporter, int(TRACE_ID, 16)) if s.name != SERVER_SPAN] == []


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "kvserve-a"}, False),  # naming alone exports nothing
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_tracing_is_off_unless_the_otel_environment_asks_for_it(environ, enabled):
    tracing = Tracing.from_environment(environ)
    try:
        assert tracing.enabled is enabled
    finally:
        tracing.shutdown()


def test_an_unknown_exporter_is_a_one_line_startup_error():
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        Tracing.from_environment({"OTEL_TRACES_EXPORTER": "zipkin"})
    result = subprocess.run([sys.executable, "-m", "kvserve.service", "--port", "0"], cwd=REPO, capture_output=True, text=True,
                            env={**subprocess_env(), "OTEL_TRACES_EXPORTER": "zipkin"}, timeout=120)  # fmt: skip
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if " INFO " not in line]  # the startup log line
    assert errors == ["kvserve serve: error: OTEL_TRACES_EXPORTER='zipkin': kvserve exports otlp, console or none"], (
        result.stderr
    )


def test_the_console_exporter_of_a_real_server_prints_the_callers_trace(tmp_path):
    """``python -m kvserve.service`` with OTEL_TRACES_EXPORTER=console: the spans of a call reach
    stdout (as JSON lines) by the time the server exits on SIGTERM."""
    env = {**subprocess_env(), "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "kvserve-test"}
    out = tmp_path / "stdout"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.service", "--host", "127.0.0.1", "--port", "0",
                                 "--log-level", "info"], cwd=REPO, env=env, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            port = None
            assert proc.stderr is not None
            for line in proc.stderr:
                if "serving kvserve.v1.GenerationService on" in line:
                    port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
                    break
            assert port, "server did not start"
            _, error = generate(f"127.0.0.1:{port}", [("traceparent", TRACEPARENT)], text="Once upon a time",
                                max_new_tokens=4)  # fmt: skip
            assert error is None
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    spans = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    names = {s["name"] for s in spans if s["context"]["trace_id"] == "0x" + TRACE_ID}
    assert names == {SERVER_SPAN, "kvserve.prepare", "kvserve.queue", "kvserve.prefill", "kvserve.decode"}
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"kvserve-test"}


def test_compose_monitoring_profile_runs_jaeger_and_the_replicas_export_to_it_only_when_asked():
    from tests.system.test_deploy import COMPOSE, compose_env, load_yaml

    compose = load_yaml(COMPOSE)
    jaeger = compose["services"]["jaeger"]
    assert jaeger["profiles"] == ["monitoring"]
    assert jaeger["image"].split(":")[0] in ("jaegertracing/all-in-one", "jaegertracing/jaeger")
    assert compose_env(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in jaeger["ports"]
    for name in ("kvserve", "kvserve-2", "kvserve-3"):
        svc = compose["services"][name]
        # Passed through from the shell; empty (tracing off) when it is not set there.
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
        assert Tracing.from_environment(compose_env(svc)).enabled is False
    # The endpoint the compose file documents names the jaeger service's OTLP/gRPC port.
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4317" in COMPOSE.read_text()
    tracing = Tracing.from_environment({**compose_env(compose["services"]["kvserve"]),
                                        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"})  # fmt: skip
    assert tracing.enabled
    tracing.shutdown()


def test_the_http_front_reads_traceparent_headers_and_ends_each_span_with_its_http_status(tiny_llama_dir, tracing, exporter):
    import urllib.error
    import urllib.request

    def post(port: int, path: str, body: dict, headers: dict) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", **headers},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    model = str(tiny_llama_dir)
    chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0, tracing=tracing) as server:
        port = server.running.http_port
        status, _ = post(port, "/v1/chat/completions", chat, {"traceparent": TRACEPARENT, "X-Session-Id": "web"})
        assert status == 200
        status, body = post(port, "/v1/chat/completions", {**chat, "stream": True}, {})
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        status, _ = post(port, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -1},
                         {"traceparent": TRACEPARENT})  # fmt: skip
        assert status == 400

    mine = spans_of(exporter, int(TRACE_ID, 16))
    ok, bad = sorted((s for s in mine if s.name.startswith("POST ")), key=lambda s: s.start_time)
    assert ok.name == "POST /v1/chat/completions" and ok.kind == SpanKind.SERVER
    assert ok.parent is not None and ok.parent.span_id == int(PARENT_ID, 16) and ok.parent.is_remote
    assert ok.attributes["http.response.status_code"] == 200 and ok.status.status_code != StatusCode.ERROR
    assert ok.attributes["kvserve.session_id"] == "web" and ok.attributes["kvserve.completion_tokens"] == 4
    children = {s.name for s in mine if s.parent is not None and s.parent.span_id == ok.context.span_id}
    assert {"kvserve.queue", "kvserve.prefill", "kvserve.decode", "kvserve.commit"} <= children
    assert bad.name == "POST /v1/completions" and bad.attributes["http.response.status_code"] == 400
    assert bad.status.status_code == StatusCode.ERROR
    # The streamed call, without a traceparent, is a trace of its own, closed with its status.
    (streamed,) = [s for s in exporter.get_finished_spans() if s.name.startswith("POST ") and s.parent is None]
    assert streamed.attributes["http.response.status_code"] == 200 and streamed.context.trace_id != int(TRACE_ID, 16)
