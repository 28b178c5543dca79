"""API keys -> tenants: keys hashed at rest, ``authorization: Bearer <key>`` on each call.

The keys file (``--api-keys-file``) or the inline setting (``--api-keys`` /
``KVSERVE_API_KEYS``) holds only SHA-256 digests of the keys, one of three formats:

* lines: ``tenant:sha256hex`` (``#`` starts a comment; a tenant may have several
  lines, e.g. while a key is rotated);
* JSON: ``{"tenant": "sha256hex", "other": ["sha256hex", "sha256hex"]}``;
* TOML: ``tenant = "sha256hex"`` / ``other = ["sha256hex", ...]``.

``kvserve hash-key`` prints the line for a key (and makes one with ``--generate``).

A presented key is hashed and compared with every stored digest by
``hmac.compare_digest`` (no early exit), so the time taken does not depend on which
digest, if any, it matches. Tenant names are 1-64 characters of ``[A-Za-z0-9._-]``.

``AuthInterceptor`` rejects calls without a valid key with UNAUTHENTICATED before any
handler runs (the request is not even parsed); health and reflection stay open so
probes work without a key. The servicer asks ``Authenticator.tenant_of(context)`` for
the caller's tenant, which owns its sessions and salts its KV namespace.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping

import grpc

TENANT_RE = re.compile(r"[A-Za-z0-9._\-]{1,64}")
_HEX64_RE = re.compile(r"[0-9a-fA-F]{64}")
_LINE_RE = re.compile(r"\s*([^:#\s]+)\s*:\s*([0-9a-fA-F]{64})\s*")

# Services any caller may use: liveness/readiness probes and schema discovery.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)

MISSING_CREDENTIALS = "missing credentials: send the metadata 'authorization: Bearer <api key>'"
INVALID_CREDENTIALS = "invalid API key"


class ApiKeysError(ValueError):
    """The keys file or setting cannot be used; the message names the source and line."""


def hash_key(key: str) -> str:
    """The stored form of an API key: SHA-256 of its UTF-8 bytes, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    """A new random API key (256 bits, URL-safe)."""
    return "kvs_" + secrets.token_urlsafe(32)


def check_tenant(tenant: str, where: str = "tenant") -> None:
    if not TENANT_RE.fullmatch(tenant):
        raise ApiKeysError(f"{where}: tenant name must be 1-64 characters of [A-Za-z0-9._-], got {tenant[:80]!r}")


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys: (SHA-256 digest, tenant) pairs. Immutable."""

    entries: tuple[tuple[bytes, str], ...] = ()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(t for _, t in self.entries)

    @classmethod
    def parse(cls, text: str, source: str = "api keys") -> ApiKeys:
        """Keys from text in any of the three formats (see the module docstring)."""
        stripped = text.strip()
        if not stripped:
            return cls()
        if stripped.startswith("{"):
            try:
                mapping = json.loads(stripped)
            except ValueError as e:
                raise ApiKeysError(f"{source}: not valid JSON: {e}") from None
            return cls._from_mapping(mapping, source)
        lines = [(i, ln.split("#", 1)[0]) for i, ln in enumerate(text.splitlines(), 1)]
        lines = [(i, ln) for i, ln in lines if ln.strip()]
        if all(_LINE_RE.fullmatch(ln) for _, ln in lines):
            pairs = []
            for i, ln in lines:
                m = _LINE_RE.fullmatch(ln)
                assert m is not None
                pairs.append((m.group(1), m.group(2), f"{source} line {i}"))
            return cls._from_pairs(pairs, source)
        if any("=" in ln for _, ln in lines):
            try:
                mapping = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ApiKeysError(f"{source}: not valid TOML: {e}") from None
            return cls._from_mapping(mapping, source)
        bad = next(i for i, ln in lines if not _LINE_RE.fullmatch(ln))
        raise ApiKeysError(
            f"{source} line {bad}: expected 'tenant:<sha256 hex of the key>' "
            f"(make one with: kvserve hash-key --tenant NAME)"
        )

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ApiKeysError(f"cannot read the API keys file {str(path)!r}: {e.strerror or e}") from None
        return cls.parse(text, source=str(path))

    @classmethod
    def _from_mapping(cls, mapping: Any, source: str) -> ApiKeys:
        if not isinstance(mapping, dict):
            raise ApiKeysError(f"{source}: expected a map of tenant -> sha256 hex (or a list of them)")
        pairs = []
        for tenant, value in mapping.items():
            digests = value if isinstance(value, list) else [value]
            for d in digests:
                if not isinstance(d, str):
                    raise ApiKeysError(f"{source}: tenant {tenant!r}: expected a sha256 hex string, got {type(d).__name__}")
                pairs.append((str(tenant), d, f"{source}: tenant {tenant!r}"))
        return cls._from_pairs(pairs, source)

    @classmethod
    def _from_pairs(cls, pairs: Iterable[tuple[str, str, str]], source: str) -> ApiKeys:
        seen: dict[bytes, str] = {}
        entries = []
        for tenant, hexdigest, where in pairs:
            check_tenant(tenant, where)
            if not _HEX64_RE.fullmatch(hexdigest):
                raise ApiKeysError(
                    f"{where}: expected the sha256 hex of the key (64 hex digits), not the key itself; "
                    "make it with: kvserve hash-key"
                )
            digest = bytes.fromhex(hexdigest)
            if digest in seen and seen[digest] != tenant:
                raise ApiKeysError(f"{where}: the same key hash is given to tenants {seen[digest]!r} and {tenant!r}")
            if digest not in seen:
                seen[digest] = tenant
                entries.append((digest, tenant))
        return cls(tuple(entries))

    def merged(self, other: ApiKeys) -> ApiKeys:
        """Both sets of keys (a digest given to two tenants is an error)."""
        return ApiKeys._from_pairs(
            [(t, d.hex(), "api keys") for d, t in self.entries + other.entries], "api keys"
        )

    def tenant_for(self, key: str) -> str | None:
        """The tenant of ``key``, or None. Compares against every digest in constant time."""
        digest = hashlib.sha256(key.encode()).digest()
        found: str | None = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, else None."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class Unauthenticated(Exception):
    """No valid credentials (UNAUTHENTICATED); the message never contains the key."""


class Authenticator:
    """Maps a call's metadata to its tenant. With no keys configured every caller is
    the tenant "" and nothing is checked."""

    def __init__(self, keys: ApiKeys | None = None) -> None:
        self.keys = keys if keys else None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, metadata: Iterable[Any] | None) -> str:
        """The tenant of the caller; raises Unauthenticated."""
        if self.keys is None:
            return ""
        token = bearer_token(metadata)
        if token is None:
            raise Unauthenticated(MISSING_CREDENTIALS)
        tenant = self.keys.tenant_for(token)
        if tenant is None:
            raise Unauthenticated(INVALID_CREDENTIALS)
        return tenant

    def tenant_of(self, context: grpc.aio.ServicerContext) -> str:
        """The servicer's ``tenant_of`` hook."""
        return self.authenticate(context.invocation_metadata())


def load_api_keys(keys_file: str | None, inline: str | None) -> ApiKeys | None:
    """The keys of the file and the inline setting together; None when neither is set."""
    if not keys_file and not inline:
        return None
    keys = ApiKeys()
    if keys_file:
        keys = keys.merged(ApiKeys.load(keys_file))
    if inline:
        keys = keys.merged(ApiKeys.parse(inline, source="--api-keys / KVSERVE_API_KEYS"))
    if not keys:
        raise ApiKeysError("API keys are configured but none were found (an empty keys file would lock everyone out)")
    return keys


def _service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").split("/", 1)[0]


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``code``.
    The request is left unparsed (no deserializer)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without a valid key, except to ``OPEN_SERVICES``.

    ``on_reject(method_name)`` is called for each rejected call (metrics).
    """

    def __init__(self, authenticator: Authenticator, on_reject: Callable[[str], None] | None = None) -> None:
        self.authenticator = authenticator
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not self.authenticator.enabled or _service_of(method) in OPEN_SERVICES:
            return handler
        try:
            self.authenticator.authenticate(handler_call_details.invocation_metadata)
        except Unauthenticated as e:
            if self._on_reject is not None:
                self._on_reject(method.rsplit("/", 1)[-1])
            return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, str(e))
        return handler


def tenant_map(keys: ApiKeys | None) -> Mapping[str, int]:
    """How many keys each tenant has (for the startup log; never the digests)."""
    out: dict[str, int] = {}
    for _, t in keys.entries if keys else ():
        out[t] = out.get(t, 0) + 1
    return out
