"""Operational endpoints: grpc.health.v1, server reflection and the Prometheus /metrics page."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvserve.clients import KVServeClient, KVServeError
from tests.fixtures.serving import ServerThread, tiny_config, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, metrics_port=_free_port())) as s:
        yield s


def test_health_answers_for_the_server_and_the_service(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvserve.v1.GenerationService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with KVServeClient(server.address) as c:
        assert c.health() == "SERVING"


def _reflect(ch: grpc.Channel, **request) -> list[reflection_pb2.ServerReflectionResponse]:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    return list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10))


def test_reflection_lists_the_services_and_describes_the_api(server):
    with grpc.insecure_channel(server.address) as ch:
        (resp,) = _reflect(ch, list_services="")
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvserve.v1.GenerationService", "grpc.health.v1.Health"} <= names

        (resp,) = _reflect(ch, file_containing_symbol="kvserve.v1.GenerationService")
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in resp.file_descriptor_response.file_descriptor_proto]  # fmt: skip
        api = next(f for f in files if f.package == "kvserve.v1")
        service = next(s for s in api.service if s.name == "GenerationService")
        methods = {m.name: m for m in service.method}
        assert set(methods) == {"Generate", "GetSession", "DeleteSession", "ListSessions", "RewindSession", "ForkSession",
                                "WarmSession", "GetModelInfo"}
        assert methods["Generate"].server_streaming and not methods["GetSession"].server_streaming


def _scrape(port: int) -> dict[str, dict[tuple, float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_endpoint_counts_requests_tokens_and_blocks(server):
    port = server.running.metrics_port
    assert port
    before = _scrape(port)
    ok_key = (("code", "OK"), ("method", "Generate"))
    with KVServeClient(server.address, timeout=60) as c:
        c.complete(token_ids=list(range(10, 42)), max_new_tokens=5)  # 32 tokens = 4 blocks of 8
        again = c.complete(token_ids=list(range(10, 42)), max_new_tokens=5)
        assert again.start.cached_tokens == 24  # 3 full blocks (the last prompt token is recomputed)
        with pytest.raises(KVServeError):
            c.complete(text="", max_new_tokens=5)
    assert wait_until(lambda: server.engine.stats().running == 0)
    after = _scrape(port)

    def delta(name: str, key: tuple = ()) -> float:
        return after.get(name, {}).get(key, 0.0) - before.get(name, {}).get(key, 0.0)

    assert delta("kvserve_requests_total", ok_key) == 2
    assert delta("kvserve_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "Generate"))) == 1
    assert delta("kvserve_generated_tokens_total") == 10
    assert delta("kvserve_prompt_tokens_total") == 64
    assert delta("kvserve_cached_prompt_tokens_total", (("tier", "device"),)) == 24
    assert delta("kvserve_time_to_first_token_seconds_count") == 2
    assert delta("kvserve_inter_token_latency_seconds_count") == 8  # 4 gaps per 5-token stream
    assert delta("kvserve_engine_prefill_tokens_total") == 32 + 8
    stats = server.engine.stats()
    blocks = after["kvserve_kv_blocks"]
    assert blocks[(("state", "free"),)] == stats.blocks_free
    assert blocks[(("state", "used"),)] == stats.blocks_total - stats.blocks_free
    assert after["kvserve_running_sequences"][()] == 0
    assert after["kvserve_waiting_sequences"][()] == 0
