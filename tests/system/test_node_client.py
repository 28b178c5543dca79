"""The Node.js example client (clients/node, @grpc/grpc-js + @grpc/proto-loader) against a
live server: it streams a two-turn session and the second turn reports cached tokens."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid

import pytest

from kvserve.clients import KVServeClient
from tests.fixtures.serving import REPO, ServerThread, tiny_config

NODE_DIR = REPO / "clients" / "node"
TURN_FIGURES = re.compile(r"^\[turn (\d+)\] (session=.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """``npm install`` in clients/node (a no-op when node_modules is current); the argv to run it."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node / npm not installed")
    result = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"npm install failed:\n{result.stdout}\n{result.stderr}"
    return [node, str(NODE_DIR / "index.js")]


def _figures(stdout: str) -> dict[int, dict[str, str]]:
    return {int(n): dict(kv.split("=", 1) for kv in line.split()) for n, line in TURN_FIGURES.findall(stdout)}


def test_node_client_streams_a_two_turn_session_whose_second_turn_is_cached(node_client, tiny_llama_dir):
    session = f"node-test-{uuid.uuid4().hex[:8]}"
    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        result = subprocess.run(
            [*node_client, "--address", server.address, "--session", session, "--max-new-tokens", "8"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        turns = _figures(result.stdout)
        assert sorted(turns) == [1, 2], result.stdout
        first, second = turns[1], turns[2]

        assert first["session"] == "created" and second["session"] == "resumed"
        assert int(first["cached_tokens"]) == 0 and first["cached_tier"] == "none"
        assert int(second["cached_tokens"]) > 0 and second["cached_tier"] == "device"
        assert int(second["cached_tokens"]) == int(second["cached_device"])
        # Turn 2 sees turn 1's whole exchange; what was cached is (at most) that prefix.
        history = int(first["prompt_tokens"]) + int(first["completion_tokens"])
        assert int(second["prompt_tokens"]) > history >= int(second["cached_tokens"])
        assert all(int(t["completion_tokens"]) == 8 or t["finish_reason"] == "stop" for t in turns.values())
        assert f"session {session} on {server.address}" in result.stdout

        # The server agrees: one session, two turns, the transcript the client's figures imply.
        with KVServeClient(server.address, timeout=60) as client:
            info = client.get_session(session)
        assert info.turns == 2
        assert info.token_count == int(second["prompt_tokens"]) + int(second["completion_tokens"])

        # A rejected turn prints its error, not a turn header before it.
        rejected = subprocess.run(
            [*node_client, "--address", server.address, "--max-new-tokens", "1000000", "--message", "hi"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert rejected.returncode == 1 and "INVALID_ARGUMENT" in rejected.stderr, rejected.stderr
        assert "[turn" not in rejected.stdout, rejected.stdout


def test_node_client_reports_an_unreachable_server_with_its_grpc_status(node_client):
    from tests.fixtures.redis_server import free_port

    result = subprocess.run(
        [*node_client, "--address", f"127.0.0.1:{free_port()}", "--timeout", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_node_client_regenerates_edits_undoes_and_forks(node_client, tiny_llama_dir):
    session = f"node-ops-{uuid.uuid4().hex[:8]}"
    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        result = subprocess.run(
            [*node_client, "--address", server.address, "--session", session, "--max-new-tokens", "6",
             "--message", "hello", "--message", "tell me about the fox", "--message", "/regenerate",
             "--message", "/edit tell me about the dog", "--message", "/undo", "--message", f"/fork {session}-b",
             "--message", "something else", "--message", "/warm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert "[turn 2] regenerate\n" in out and "[turn 2] user (edit): tell me about the dog\n" in out, out
        undo = re.search(r"\[undo\] session=\S+ turns=1 token_count=(\d+) dropped_tokens=(\d+)", out)
        fork = re.search(r"\[fork\] session=(\S+) from=\S+ turns=1 token_count=(\d+) shared_blocks=(\d+)/(\d+)", out)
        assert undo and fork and fork.group(1) == f"{session}-b" and fork.group(2) == undo.group(1), out
        assert fork.group(3) == fork.group(4), out  # every full block of the fork is the source's, on the device
        assert "[turn 2] user: something else" in out, out
        warm = re.search(r"\[warm\] session=(\S+) blocks=(\d+) on_device=(\d+) restored=0 missing=0 over_cap=0", out)
        assert warm and warm.group(1) == f"{session}-b" and warm.group(2) == warm.group(3) != "0", out  # on the device
        with KVServeClient(server.address, timeout=60) as client:
            trunk = client.get_session(session, include_token_ids=True)
            branch = client.get_session(f"{session}-b", include_token_ids=True, include_turns=True)
        assert trunk.turns == 1 and branch.turns == 2 and branch.token_ids[: trunk.token_count] == trunk.token_ids


def test_node_client_constrains_replies_with_a_regex_or_a_json_schema(node_client, tiny_llama_dir):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        base = [*node_client, "--address", server.address, "--max-new-tokens", "16", "--message", "hi"]
        rx = subprocess.run([*base, "--regex", "[0-9]{3}"], capture_output=True, text=True, timeout=120)
        js = subprocess.run([*base, "--json-schema", json.dumps(schema)], capture_output=True, text=True, timeout=120)
        both = subprocess.run([*base, "--regex", "x", "--json-schema", "{}"], capture_output=True, text=True, timeout=120)
        bad = subprocess.run([*base, "--regex", "(x"], capture_output=True, text=True, timeout=120)
    reply = re.compile(r"^\[turn 1\] assistant: (.*)$", re.MULTILINE)
    assert rx.returncode == 0 and re.fullmatch(r"[0-9]{3}", reply.search(rx.stdout).group(1)), rx.stdout + rx.stderr
    assert js.returncode == 0 and isinstance(json.loads(reply.search(js.stdout).group(1))["ok"], bool), js.stdout
    assert both.returncode == 2 and "at most one of --json-schema and --regex" in both.stderr
    assert bad.returncode == 1 and "INVALID_ARGUMENT: response_format regex cannot be used" in bad.stderr, bad.stderr


@pytest.mark.parametrize(
    "message, error",
    [
        ("/edit", '--message "/edit": /edit needs TEXT'),
        ("/fork", '--message "/fork": /fork needs NAME'),
        ("/undo 2", '--message "/undo 2": /undo takes no argument'),
        ("/help", '--message "/help": unknown operation /help'),
    ],
)
def test_node_client_refuses_a_mistyped_operation_before_any_call(node_client, message, error):
    """Never sent to the model as a turn's text: a usage error (exit 2) before connecting
    (the address is unused), and // sends a message that begins with /."""
    result = subprocess.run(
        [*node_client, "--address", "127.0.0.1:1", "--message", "hi", "--message", message],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.startswith(f"usage error: {error}"), result.stderr
    assert result.stdout == ""


def test_node_client_sends_a_double_slash_message_as_text(node_client, tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        result = subprocess.run(
            [*node_client, "--address", server.address, "--session", "node-slash", "--max-new-tokens", "4",
             "--message", "//etc is a folder"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "[turn 1] user: /etc is a folder\n" in result.stdout
        with KVServeClient(server.address, timeout=60) as client:
            assert client.get_session("node-slash").turns == 1


def test_node_client_switches_speculative_decoding(node_client, tiny_llama_dir):
    """--speculative on|off sets SamplingParams.speculative; each turn's line then ends
    with the drafts of FinalEvent.timings (none with off: one token a step)."""
    phrase = "the cat sat on the mat. " * 3 + "the cat"
    with ServerThread(tiny_config(tiny_llama_dir)) as server:
        runs = {
            mode: subprocess.run([*node_client, "--address", server.address, "--session", f"node-spec-{mode}-{uuid.uuid4().hex[:6]}",
                                  "--max-new-tokens", "16", "--message", phrase, "--speculative", mode],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            for mode in ("on", "off")
        }
        bad = subprocess.run([*node_client, "--address", server.address, "--speculative", "maybe"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    for mode, r in runs.items():
        assert r.returncode == 0, r.stdout + r.stderr
    on, off = _figures(runs["on"].stdout)[1], _figures(runs["off"].stdout)[1]
    assert (int(off["draft_tokens"]), float(off["tokens_per_step"])) == (0, 1.0)
    assert int(on["draft_tokens"]) >= int(on["accepted_draft_tokens"]) >= 0
    assert float(on["tokens_per_step"]) == pytest.approx(
        int(on["completion_tokens"]) / (int(on["completion_tokens"]) - int(on["accepted_draft_tokens"])), abs=0.01)
    assert bad.returncode == 2 and "--speculative must be on or off" in bad.stderr
