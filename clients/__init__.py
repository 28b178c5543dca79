"""Python clients of kvserve (sync and asyncio) and the ``kvserve-chat`` console command."""

from clients.client import (
    SESSION_METADATA_KEY,
    AsyncGenerateStream,
    AsyncKVServeClient,
    Completion,
    GenerateStream,
    KVServeClient,
    KVServeError,
    SessionInfo,
    SessionTurn,
    StreamEnd,
    StreamStart,
    TextDelta,
    Timings,
    TLSConfig,
    TokenLogprob,
    build_request,
)

__all__ = [
    "SESSION_METADATA_KEY",
    "AsyncGenerateStream",
    "AsyncKVServeClient",
    "Completion",
    "GenerateStream",
    "KVServeClient",
    "KVServeError",
    "SessionInfo",
    "SessionTurn",
    "StreamEnd",
    "StreamStart",
    "TLSConfig",
    "TextDelta",
    "Timings",
    "TokenLogprob",
    "build_request",
]
