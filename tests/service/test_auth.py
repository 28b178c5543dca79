"""Tenants and API keys: keys hashed at rest, UNAUTHENTICATED without a valid one,
sessions and KV namespaces per tenant, operator-shared salts, open health/reflection."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.auth import (
    ApiKeys,
    ApiKeysError,
    Authenticator,
    Unauthenticated,
    bearer_token,
    hash_key,
    load_api_keys,
)
from tests.fixtures.serving import BLOCK_SIZE, REPO, ServerThread, subprocess_env, tiny_config

KEY_A, KEY_A2, KEY_B = "key-of-acme-1", "key-of-acme-2 (rotated)", "key-of-bravo"
SHARED = "public-system-prompt"
PROMPT = list(range(20, 20 + 3 * BLOCK_SIZE + 2))  # 3 full blocks and a tail


# ----------------------------------------------------------------------------- keys, unit


def test_three_file_formats_give_the_same_keys(tmp_path):
    lines = f"# comment\nacme:{hash_key(KEY_A)}\n\nacme:{hash_key(KEY_A2)}  # rotated\nbravo:{hash_key(KEY_B)}\n"
    as_json = json.dumps({"acme": [hash_key(KEY_A), hash_key(KEY_A2)], "bravo": hash_key(KEY_B)})
    as_toml = f'acme = ["{hash_key(KEY_A)}", "{hash_key(KEY_A2)}"]\nbravo = "{hash_key(KEY_B)}"\n'
    parsed = [ApiKeys.parse(t) for t in (lines, as_json, as_toml)]
    assert parsed[0] == parsed[1] == parsed[2] and len(parsed[0]) == 3
    keys = parsed[0]
    assert keys.tenant_for(KEY_A) == keys.tenant_for(KEY_A2) == "acme"
    assert keys.tenant_for(KEY_B) == "bravo"
    assert keys.tenant_for("key-of-acme-3") is None and keys.tenant_for("") is None
    # the stored form is only digests: no key text anywhere
    assert all(KEY_A.encode() not in d for d, _ in keys.entries)
    path = tmp_path / "keys.toml"
    path.write_text(as_toml)
    assert load_api_keys(str(path), f"carol:{hash_key('c')}").tenant_for("c") == "carol"
    assert load_api_keys(None, None) is None


@pytest.mark.parametrize(
    "text,match",
    [
        (f"acme:{KEY_A}", "line 1: expected 'tenant:<sha256 hex"),  # a key instead of its hash
        ('{"acme": "not-a-hash"}', "not the key itself"),
        (f"bad tenant!:{hash_key(KEY_A)}", "line 1: expected"),
        (json.dumps({"a/b": hash_key(KEY_A)}), "tenant name must be"),
        (f"acme:{hash_key(KEY_A)}\nbravo:{hash_key(KEY_A)}", "same key hash is given to tenants 'acme' and 'bravo'"),
        ('{"acme": ', "not valid JSON"),
        ('["x"]', "expected 'tenant:"),
        ("acme = [1, 2]", "expected a sha256 hex string"),
    ],
)  # fmt: skip
def test_bad_key_files_are_refused_with_the_place(text, match):
    with pytest.raises(ApiKeysError, match=match):
        ApiKeys.parse(text)


def test_empty_keys_are_refused_and_unreadable_files_named(tmp_path):
    (tmp_path / "empty").write_text("# nobody yet\n")
    with pytest.raises(ApiKeysError, match="none were found"):
        load_api_keys(str(tmp_path / "empty"), None)
    with pytest.raises(ApiKeysError, match="cannot read the API keys file"):
        load_api_keys(str(tmp_path / "missing"), None)


def test_bearer_metadata_and_authenticator():
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None
    auth = Authenticator(ApiKeys.parse(f"acme:{hash_key(KEY_A)}"))
    assert auth.authenticate([("authorization", f"Bearer {KEY_A}")]) == "acme"
    with pytest.raises(Unauthenticated, match="missing credentials"):
        auth.authenticate([])
    with pytest.raises(Unauthenticated, match="invalid API key") as err:
        auth.authenticate([("authorization", "Bearer guess")])
    assert "guess" not in str(err.value)
    assert Authenticator(None).authenticate([]) == ""  # keys off: one anonymous tenant


def test_hash_key_command_prints_a_line_the_server_accepts():
    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvserve.service.cli", "hash-key", *args], cwd=REPO, env=subprocess_env(),
            input=stdin, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    out = run("--tenant", "acme", stdin=KEY_A + "\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"acme:{hash_key(KEY_A)}"
    assert ApiKeys.parse(out.stdout).tenant_for(KEY_A) == "acme"
    gen = run("--tenant", "bravo", "--generate")
    new_key, line = [ln for ln in gen.stdout.splitlines() if not ln.startswith("#")]
    assert ApiKeys.parse(line).tenant_for(new_key) == "bravo"
    assert run("--tenant", "no way").returncode == 2
    assert run(stdin="").returncode == 2
    as_argument = run("--tenant", "acme", KEY_A)  # accepted, with a warning about shell history
    assert as_argument.returncode == 0 and as_argument.stdout.strip() == f"acme:{hash_key(KEY_A)}"
    assert "shell history" in as_argument.stderr
    assert run("--generate", KEY_A).returncode == 2


def test_serve_refuses_a_bad_keys_file_before_loading_anything(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text(f"acme:{KEY_A}\n")  # the key itself, not its hash
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.service", "--api-keys-file", str(bad), "--model", str(tmp_path / "no-model")],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert "line 1" in out.stderr and KEY_A not in out.stderr


# ----------------------------------------------------------------------------- a live server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    keys = f"acme:{hash_key(KEY_A)}\nacme:{hash_key(KEY_A2)}\nbravo:{hash_key(KEY_B)}\n"
    cfg = tiny_config(tiny_llama_dir, api_keys=keys, shared_cache_salts=(SHARED,))
    with ServerThread(cfg) as s:
        yield s


def _client(server, key):
    return KVServeClient(server.address, token=key, timeout=60)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(KVServeError) as err:
        call()
    return err.value.code


def test_every_api_call_needs_a_valid_key(server):
    for key in (None, "wrong-key", KEY_A + "x"):
        with _client(server, key) as c:
            for call in (
                lambda: c.complete(token_ids=[5, 6, 7], max_new_tokens=2),
                lambda: c.get_session("s"),
                lambda: c.delete_session("s"),
                lambda: c.list_sessions(),
                lambda: c.model_info(),
            ):
                with pytest.raises(KVServeError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert ("missing credentials" if key is None else "invalid API key") in err.value.details
                assert key is None or key not in err.value.details
    # a session id in a rejected call was never created
    with _client(server, KEY_A) as c:
        assert _code(lambda: c.get_session("s")) == grpc.StatusCode.NOT_FOUND
    # rejections are counted by method and code
    counted = server.running.metrics.requests.labels("Generate", "UNAUTHENTICATED")._value.get()
    assert counted >= 3


def test_health_and_reflection_stay_open(server):
    with grpc.insecure_channel(server.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (r,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert "kvserve.v1.GenerationService" in {s.name for s in r.list_services_response.service}


def test_sessions_belong_to_their_tenant(server):
    with _client(server, KEY_A) as a, _client(server, KEY_A2) as a2, _client(server, KEY_B) as b:
        a.complete(token_ids=[5, 6, 7, 8], session_id="shared-name", max_new_tokens=3)
        t_a = a.get_session("shared-name", include_token_ids=True).token_ids
        assert a2.get_session("shared-name").token_count == len(t_a)  # both keys are acme
        assert _code(lambda: b.get_session("shared-name")) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: b.delete_session("shared-name")) == grpc.StatusCode.NOT_FOUND
        assert "shared-name" not in [s.session_id for s in b.iter_sessions()]
        # bravo's own session of the same name is a different conversation
        b.complete(token_ids=[9, 9], session_id="shared-name", max_new_tokens=2)
        assert b.get_session("shared-name").token_count == 4
        assert a.get_session("shared-name", include_token_ids=True).token_ids == t_a
        b.delete_session("shared-name")
        assert a.get_session("shared-name").turns == 1  # acme's survived bravo's delete


def test_kv_is_never_shared_across_tenants_or_request_salts(server):
    full = 3 * BLOCK_SIZE
    prompt = [p + 100 for p in PROMPT]
    with _client(server, KEY_A) as a, _client(server, KEY_B) as b:
        assert a.complete(token_ids=prompt, max_new_tokens=2).start.cached_tokens == 0
        assert a.complete(token_ids=prompt, max_new_tokens=2).start.cached_tokens == full  # same tenant: a hit
        assert b.complete(token_ids=prompt, max_new_tokens=2).start.cached_tokens == 0  # other tenant: a miss
        # the same request salt does not join two tenants either
        assert a.complete(token_ids=prompt, max_new_tokens=2, cache_salt="x").start.cached_tokens == 0
        assert b.complete(token_ids=prompt, max_new_tokens=2, cache_salt="x").start.cached_tokens == 0
        assert a.complete(token_ids=prompt, max_new_tokens=2, cache_salt="x").start.cached_tokens == full


def test_an_operator_shared_salt_shares_kv_across_tenants(server):
    full = 3 * BLOCK_SIZE
    prompt = [p + 200 for p in PROMPT]
    with _client(server, KEY_A) as a, _client(server, KEY_B) as b:
        first = a.complete(token_ids=prompt, max_new_tokens=4, cache_salt=SHARED)
        assert first.start.cached_tokens == 0
        hit = b.complete(token_ids=prompt, max_new_tokens=4, cache_salt=SHARED)
        assert hit.start.cached_tokens == full and hit.start.cached_tier == "device"
        assert hit.token_ids == first.token_ids  # same KV, same greedy output
        # without the shared salt each tenant is on its own again
        assert b.complete(token_ids=prompt, max_new_tokens=4).start.cached_tokens == 0
