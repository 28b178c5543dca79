"""OpenTelemetry traces of Generate calls: one server span per call, its parent taken
from the caller's W3C ``traceparent`` metadata, with a child span per phase: prepare
(session record and turn lock, tokenizing, checks), then the phases the engine times
(queue, restore, prefill, decode), then commit (a session's new transcript written, the
final event sent).

Off unless the standard OpenTelemetry environment asks for it (``Tracing.from_environment``):

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set: spans go
  to that OTLP/gRPC endpoint (a collector, Jaeger) in batches; every other
  ``OTEL_EXPORTER_OTLP_*`` variable (headers, timeout, certificate, compression) is read
  by the exporter itself;
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (the default once an endpoint is set), ``console``
  (one JSON span per line on stdout) or ``none``; ``OTEL_SDK_DISABLED=true`` turns it off;
- ``OTEL_SERVICE_NAME`` (default ``kvserve``) and ``OTEL_RESOURCE_ATTRIBUTES`` name the
  process; ``OTEL_TRACES_SAMPLER`` / ``_ARG`` choose the sampler (default: follow the
  caller's sampling decision, sample every root).

Off, a call costs one attribute lookup: ``Tracing.off().generate(...)`` returns a
no-op. The phase spans are laid out from the engine's ``Timings`` when the stream ends
(``arrival -> queue -> restore -> prefill -> first token -> decode -> last token``), so
the engine keeps no tracing state; the restore span carries, per tier, the blocks and
bytes it copied into the device pool (host and Redis are read in one pass, so the time
is the restore's, not split by tier).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .types import Finished, Started, Tier

log = logging.getLogger("kvserve.tracing")

TRACER_NAME = "kvserve"
_PHASES = ("queue", "restore", "prefill", "decode")


def _endpoint_set(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class _NoTrace:
    """What a call gets while tracing is off."""

    def started(self, event: Started, block_size: int, bytes_per_token: int) -> None:
        pass

    def finished(self, event: Finished) -> None:
        pass

    def end(self, code: str, message: str = "") -> None:
        pass


_NO_TRACE = _NoTrace()


class GenerateTrace:
    """The spans of one Generate call; ``end`` closes them (exactly once)."""

    def __init__(self, tracer: Any, parent: Any, request_id: str, session_id: str, http_route: str | None = None) -> None:
        from opentelemetry.trace import SpanKind

        self._tracer = tracer
        self._start = time.time_ns()
        self._http = http_route is not None
        if http_route is not None:  # the OpenAI-compatible HTTP front
            name = f"POST {http_route}"
            front: dict[str, Any] = {"http.request.method": "POST", "http.route": http_route}
        else:
            name = "kvserve.v1.GenerationService/Generate"
            front = {"rpc.system": "grpc", "rpc.service": "kvserve.v1.GenerationService", "rpc.method": "Generate"}
        self.span = tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._start,
            attributes={
                **front,
                "kvserve.request_id": request_id,
                **({"kvserve.session_id": session_id} if session_id else {}),
            },
        )
        self._restored: dict[str, int] = {}  # attributes of the restore span
        self._session = bool(session_id)
        self._finished_at: int | None = None  # when the engine's last event arrived
        self._ended = False

    def started(self, event: Started, block_size: int, bytes_per_token: int) -> None:
        """The prompt was admitted: its size and where its cached prefix came from."""
        attrs: dict[str, Any] = {
            "kvserve.prompt_tokens": event.prompt_tokens,
            "kvserve.cached_tokens": event.cached_tokens,
            "kvserve.cached_tier": str(event.cached_tier) if event.cached_tier else "none",
        }
        for tier, tokens in event.cached_by_tier.items():
            attrs[f"kvserve.cached_tokens.{tier}"] = tokens
            if tier != Tier.DEVICE and tokens:
                blocks = tokens // block_size
                self._restored[f"kvserve.restore.{tier}.blocks"] = blocks
                self._restored[f"kvserve.restore.{tier}.bytes"] = blocks * block_size * bytes_per_token
        self.span.set_attributes(attrs)

    def finished(self, event: Finished) -> None:
        """The last event: lay the phase spans out from the engine's timings, ending now."""
        t = event.timings
        self.span.set_attributes({
            "kvserve.completion_tokens": event.completion_tokens,
            "kvserve.finish_reason": event.finish_reason.value,
        })  # fmt: skip
        end = time.time_ns()
        first = end - _ns(t.decode_s) if t.ttft_s else end
        arrival = first - _ns(t.ttft_s)
        restore_at = arrival + _ns(t.queue_s)
        prefill_at = restore_at + _ns(t.restore_s)
        self._finished_at = end
        spans = [("prepare", self._start, max(arrival, self._start), {}), ("queue", arrival, restore_at, {})]
        if t.restore_s or self._restored:
            spans.append(("restore", restore_at, prefill_at, self._restored))
        if t.ttft_s:
            spans.append(("prefill", prefill_at, first, {"kvserve.prefill_tokens": event.prompt_tokens - event.cached_tokens}))
            spans.append(("decode", first, end, {"kvserve.decode_tokens": max(event.completion_tokens - 1, 0)}))
        self._children(spans)

    def _children(self, spans: list[tuple[str, int, int, dict[str, Any]]]) -> None:
        from opentelemetry import trace

        ctx = trace.set_span_in_context(self.span)
        for name, start, stop, attrs in spans:
            child = self._tracer.start_span(f"kvserve.{name}", context=ctx, start_time=start, attributes=attrs)
            child.end(end_time=max(stop, start))

    def end(self, code: str | int, message: str = "") -> None:
        """Close the call's span with its gRPC status code name (``OK``, ``CANCELLED``...),
        or for an HTTP call its HTTP status (200, 400...; 499 when the client went away)."""
        if self._ended:
            return
        self._ended = True
        from opentelemetry.trace import Status, StatusCode

        if self._session and self._finished_at is not None:
            self._children([("commit", self._finished_at, time.time_ns(), {})])
        if self._http:
            self.span.set_attribute("http.response.status_code", int(code))
            failed = int(code) >= 400
        else:
            self.span.set_attribute("rpc.grpc.status_code", str(code))
            failed = code != "OK"
        if failed:
            self.span.set_status(Status(StatusCode.ERROR, f"{code}: {message}" if message else code))
        self.span.end()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracing:
    """Builds a ``GenerateTrace`` per call from a tracer provider, or no-ops when off."""

    def __init__(self, tracer_provider: Any | None = None) -> None:
        self.enabled = tracer_provider is not None
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(TRACER_NAME) if tracer_provider is not None else None
        self._propagator: Any = None
        if self.enabled:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Tracing:
        """Tracing as the OTEL_* variables describe (module docstring); off when none is set."""
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls.off()
        exporter_name = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporter_name in ("", "otlp") and not _endpoint_set(environ):
            return cls.off()
        if exporter_name == "none":
            return cls.off()
        if exporter_name not in ("", "otlp", "console"):
            raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: kvserve exports otlp, console or none")
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter_name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter: Any = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself
        # Resource.create merges OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES over this default
        service = {"service.name": environ.get("OTEL_SERVICE_NAME") or "kvserve"}
        provider = TracerProvider(resource=Resource.create(service))  # sampler from OTEL_TRACES_SAMPLER
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing on: %s exporter", exporter_name or "otlp")
        return cls(provider)

    def generate(
        self, metadata: Sequence[tuple[str, Any]] | None, request_id: str, session_id: str,
        http_route: str | None = None,
    ) -> Any:  # fmt: skip
        """Start the spans of one Generate call whose invocation metadata (or, on the HTTP
        front, request headers, with ``http_route`` set) is ``metadata``."""
        if not self.enabled:
            return _NO_TRACE
        carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate") and isinstance(v, str)}
        parent = self._propagator.extract(carrier) if carrier else None
        return GenerateTrace(self._tracer, parent, request_id, session_id, http_route)

    def shutdown(self) -> None:
        """Flush what is buffered (on server exit)."""
        if self._provider is not None:
            try:
                self._provider.shutdown()
            except Exception:  # noqa: BLE001 - an unreachable collector must not fail the exit
                log.warning("tracing: could not flush spans on shutdown", exc_info=True)
