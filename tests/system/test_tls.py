"""TLS on the gRPC port, mutual TLS with a client CA, and rediss:// to Redis, with
certificates made in the test (openssl CLI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError, TLSConfig
from kvserve.service.auth import hash_key
from tests.fixtures.redis_server import TLSFiles, make_tls_files
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config, wait_until

KEY = "tls-tenant-key"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_client_cert(ca: TLSFiles, directory: Path, name: str) -> tuple[bytes, bytes]:
    """A client certificate (clientAuth) signed by ``ca``: (key PEM, certificate PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    key, csr, cert, ext = (directory / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    ext.write_text("extendedKeyUsage=clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.ca_cert), "-CAkey", str(ca.ca_cert.with_suffix(".key")),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return key.read_bytes(), cert.read_bytes()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ours, rogue = make_tls_files(root / "ours"), make_tls_files(root / "rogue")
    return {
        "ours": ours,
        "rogue": rogue,
        "client": make_client_cert(ours, root / "clients", "good-client"),
        "rogue_client": make_client_cert(rogue, root / "clients", "rogue-client"),
    }


def _fails(address: str, **client_kwargs) -> grpc.StatusCode:
    with KVServeClient(address, timeout=10, **client_kwargs) as c, pytest.raises(KVServeError) as err:
        c.complete(token_ids=[5, 6, 7], max_new_tokens=2)
    return err.value.code


def test_tls_port_with_bearer_keys_and_redis_over_tls(tiny_llama_dir, pki, make_redis_server):
    redis = make_redis_server(tls=True)  # rediss://, certificate from its own throwaway CA
    assert redis.url.startswith("rediss://")
    ours = pki["ours"]
    cfg = tiny_config(
        tiny_llama_dir,
        tls_cert=str(ours.cert), tls_key=str(ours.key),
        api_keys=f"acme:{hash_key(KEY)}",
        redis_url=redis.url, redis_tls_ca=str(redis.tls.ca_cert),
        host_cache_memory=0, spill_after=0.05, spill_to=("redis",),
    )  # fmt: skip
    with ServerThread(cfg) as srv:
        tls = TLSConfig(root_certificates=ours.ca_cert.read_bytes())
        with KVServeClient(srv.address, tls=tls, token=KEY, timeout=60) as c:
            r = c.complete(token_ids=list(range(10, 10 + 3 * BLOCK_SIZE)), session_id="t", max_new_tokens=4)
            assert r.end.finish_reason == "length" and len(r.token_ids) == 4
            assert c.health() == "SERVING"
            # the session record and its KV blocks reached Redis over TLS
            n = (3 * BLOCK_SIZE + 4) // BLOCK_SIZE
            assert wait_until(lambda: c.get_session("t").cached_blocks.get("redis", 0) == n, timeout=30)
        with redis.client() as rc:
            assert any(b"sess:acme:t" in k for k in rc.keys("*"))
        # the right CA but no key: TLS is not authentication
        assert _fails(srv.address, tls=tls) == grpc.StatusCode.UNAUTHENTICATED
        # plaintext on a TLS port, or a server certificate from a CA we do not trust: no channel
        assert _fails(srv.address, token=KEY) == grpc.StatusCode.UNAVAILABLE
        rogue_ca = TLSConfig(root_certificates=pki["rogue"].ca_cert.read_bytes())
        assert _fails(srv.address, tls=rogue_ca, token=KEY) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(tiny_llama_dir, pki):
    ours = pki["ours"]
    cfg = tiny_config(tiny_llama_dir, tls_cert=str(ours.cert), tls_key=str(ours.key), tls_client_ca=str(ours.ca_cert))
    root = ours.ca_cert.read_bytes()
    with ServerThread(cfg) as srv:
        key, chain = pki["client"]
        good = TLSConfig(root_certificates=root, private_key=key, certificate_chain=chain)
        with KVServeClient(srv.address, tls=good, timeout=60) as c:
            assert len(c.complete(token_ids=[5, 6, 7], max_new_tokens=3).token_ids) == 3
        assert _fails(srv.address, tls=TLSConfig(root_certificates=root)) == grpc.StatusCode.UNAVAILABLE
        rkey, rchain = pki["rogue_client"]
        rogue = TLSConfig(root_certificates=root, private_key=rkey, certificate_chain=rchain)
        assert _fails(srv.address, tls=rogue) == grpc.StatusCode.UNAVAILABLE
        # the server kept serving
        with KVServeClient(srv.address, tls=good, timeout=60) as c:
            assert c.health() == "SERVING"


def test_tls_settings_are_checked_at_startup(tmp_path):
    from kvserve.service.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match="--tls-key / KVSERVE_TLS_KEY and --tls-cert"):
        ServerConfig(tls_cert="/x.crt")
    with pytest.raises(ConfigError, match="--tls-client-ca / KVSERVE_TLS_CLIENT_CA needs --tls-cert"):
        ServerConfig(tls_client_ca="/ca.crt")
    with pytest.raises(ConfigError, match="needs a rediss:// --redis-url"):
        ServerConfig(redis_url="redis://127.0.0.1:1/0", redis_tls_ca="/ca.crt")
    url = ServerConfig(redis_url="rediss://:pw@h:1/0", redis_tls_ca="/a b/ca.crt").redis_connection_url()
    assert url == "rediss://:pw@h:1/0?ssl_ca_certs=%2Fa+b%2Fca.crt"

    from kvserve.service.server import server_credentials

    with pytest.raises(ConfigError, match="cannot read the TLS certificate"):
        server_credentials(ServerConfig(tls_cert=str(tmp_path / "none.crt"), tls_key=str(tmp_path / "none.key")))
