"""kvserve-chat driven through its stdin (a pipe) against a live server."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from kvserve.clients import KVServeClient
from tests.fixtures.serving import BLOCK_SIZE, REPO, ServerThread, subprocess_env, tiny_config

STATS = re.compile(r"\[cached (\d+)/(\d+) prompt tokens(?: \((\w+)\))? · ttft (\d+) ms · ([\d.]+) tok/s(?: · (\w+))?\]")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir)) as s:
        yield s


def _chat(address: str, stdin: str, *args: str, status: int = 0, quiet: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.clients.chat", "--address", address, "--max-new-tokens", "10", *args],
        input=stdin, capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == status, proc.stderr
    if quiet:
        assert not proc.stderr.strip(), proc.stderr
    return proc


def test_two_turn_session_through_stdin_then_resume(server):
    out = _chat(server.address, "hello there\ntell me about the fox\n/quit\nnever sent\n", "--session", "cli-1").stdout
    assert out.startswith("[session cli-1: new]\n")
    stats = STATS.findall(out)
    assert len(stats) == 2, out
    (c1, p1, tier1, *_), (c2, p2, tier2, *_) = stats
    assert int(c1) == 0 and tier1 == ""
    with KVServeClient(server.address) as client:
        info = client.get_session("cli-1", include_token_ids=True)
    assert info.turns == 2
    # turn 2 found turn 1's whole transcript (its full blocks) on the device
    assert tier2 == "device" and int(c2) > 0 and int(c2) % BLOCK_SIZE == 0 and int(p2) > int(p1)
    # the streamed reply text is printed between the stats lines
    assert out.count("\n[cached") == 2

    warm0 = server.engine.cache_stats().warm
    resumed = _chat(server.address, "and the dog?\n", "--session", "cli-1").stdout
    assert resumed.startswith(f"[session cli-1: resumed, 2 turns, {info.token_count} tokens]\n")
    ((c3, p3, tier3, *_),) = STATS.findall(resumed)
    assert tier3 == "device" and int(c3) == info.token_count // BLOCK_SIZE * BLOCK_SIZE and int(p3) > info.token_count
    # the resumed session was warmed up (WarmSession) before its turn, which used the warmed blocks
    warm = server.engine.cache_stats().warm
    assert (warm.requests - warm0.requests, warm.hits - warm0.hits) == (1, 1)
    assert warm.claimed_blocks - warm0.claimed_blocks == info.token_count // BLOCK_SIZE


def test_reset_starts_a_new_session_and_deletes_the_old(server):
    out = _chat(server.address, "first\n/reset\nsecond\n", "--session", "cli-reset").stdout
    sessions = re.findall(r"\[session (\S+): new\]", out)
    assert sessions[0] == "cli-reset" and len(sessions) == 2 and sessions[1] != "cli-reset"
    with KVServeClient(server.address) as client:
        ids = {s.session_id for s in client.iter_sessions()}
    assert "cli-reset" not in ids and sessions[1] in ids


def test_exit_status_is_non_zero_when_the_last_turn_failed(server):
    too_long = "fox " * 5000 + "\n"  # past the tiny model's context: INVALID_ARGUMENT
    failed = _chat(server.address, "hello\n" + too_long, "--session", "cli-fail", status=1, quiet=False)
    assert failed.stderr.startswith("[error INVALID_ARGUMENT:"), failed.stderr
    recovered = _chat(server.address, too_long + "hello again\n", "--session", "cli-fail-2", quiet=False)
    assert "[error INVALID_ARGUMENT:" in recovered.stderr and len(STATS.findall(recovered.stdout)) == 1


def test_a_session_whose_history_is_gone_is_said_so_and_started_over(server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.clients.chat", "--address", server.address, "--max-new-tokens", "6",
         "--session", "cli-gone"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=subprocess_env(),
    )  # fmt: skip
    try:
        proc.stdin.write("hello there\n")
        proc.stdin.flush()
        lines = []
        while not STATS.search(lines[-1] if lines else ""):  # the first turn's figures
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines) + proc.stderr.read()
        with KVServeClient(server.address, timeout=60) as c:
            c.delete_session("cli-gone")  # the history is gone (as after a TTL or a lost Redis)
        out, err = proc.communicate("and now?\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[session cli-gone: the server no longer has its history" in out
    assert len(STATS.findall(out)) == 1  # the second turn ran, as a new session
    with KVServeClient(server.address, timeout=60) as c:
        assert c.get_session("cli-gone").turns == 1


def test_regenerate_edit_undo_and_fork(server):
    script = "hello there\ntell me about the fox\n/regenerate 1.5\n/edit tell me about the dog\n/undo\n" \
             "/fork cli-branch\nsomething else\n"  # fmt: skip
    out = _chat(server.address, script, "--session", "cli-ops").stdout
    assert len(STATS.findall(out)) == 5, out  # two turns, regenerate, edit, the branch's turn
    assert re.search(r"\[session cli-ops: undid the last turn \(\d+ tokens\); 1 turns, \d+ tokens\]", out), out
    m = re.search(r"\[session cli-branch: forked from cli-ops at turn 1, (\d+) tokens \((\d+)/(\d+) blocks shared", out)
    assert m and m.group(2) == m.group(3), out
    with KVServeClient(server.address) as client:
        trunk = client.get_session("cli-ops", include_token_ids=True, include_turns=True)
        branch = client.get_session("cli-branch", include_token_ids=True, include_turns=True)
    assert trunk.turns == 1 and branch.turns == 2 and trunk.token_count == int(m.group(1))
    assert branch.token_ids[: trunk.token_count] == trunk.token_ids
    # a bad command says why on stderr and the exit status says it failed
    bad = _chat(server.address, "/fork\n", "--session", "cli-ops", status=1, quiet=False)
    assert "usage: /fork NAME" in bad.stderr
    bad = _chat(server.address, "/fork cli-branch\n", "--session", "cli-ops", status=1, quiet=False)
    assert "ALREADY_EXISTS" in bad.stderr


class _Lines(io.StringIO):
    """stdin whose lines may run an action first (another client acting between lines)."""

    def __init__(self, lines: list) -> None:
        super().__init__()
        self._lines = list(lines)

    def readline(self, *args: object) -> str:
        if not self._lines:
            return ""
        item = self._lines.pop(0)
        if callable(item):
            item()
            return self.readline()
        return item + "\n"


def test_undo_and_regenerate_never_touch_a_turn_another_client_added(server, capsys):
    from kvserve.clients.chat import main as chat_main

    with KVServeClient(server.address) as other:
        stdin = _Lines([
            "hello there",
            lambda: other.chat("cli-shared", "a turn from elsewhere", max_new_tokens=4),
            "/undo",  # refused: the chat knows 1 turn, the session has 2
            "/undo",  # the chat has read the session again: drops the other client's turn
            "/regenerate",
        ])  # fmt: skip
        out = io.StringIO()
        status = chat_main(["--address", server.address, "--session", "cli-shared", "--max-new-tokens", "4"],
                           stdin=stdin, stdout=out)  # fmt: skip
        assert status == 0, capsys.readouterr().err
        assert "has 2 completed turns, the request expected 1 (expected_turns)" in capsys.readouterr().err
        assert "undid the last turn" in out.getvalue() and len(STATS.findall(out.getvalue())) == 2
        assert other.get_session("cli-shared").turns == 1


def test_an_unknown_command_is_refused_not_sent_and_help_lists_the_commands(server):
    """A mistyped command (or one with a stray argument) is never a turn's text: the chat
    says so, sends nothing, and exits 1 when it was the last line; /help lists the
    commands, --help too; // sends a message that begins with /."""
    bad = _chat(server.address, "/help\n/regen\n/undo 2\n", "--session", "cli-unknown", status=1, quiet=False)
    assert "/regenerate [TEMPERATURE]" in bad.stdout and "/fork NAME" in bad.stdout  # /help
    assert "[unknown command /regen: /help lists the commands" in bad.stderr
    assert "[usage: /undo takes no argument, got '2']" in bad.stderr
    assert not STATS.findall(bad.stdout)
    with KVServeClient(server.address) as client:
        assert "cli-unknown" not in {s.session_id for s in client.iter_sessions()}
    slash = _chat(server.address, "//etc is a folder\n", "--session", "cli-slash")
    assert len(STATS.findall(slash.stdout)) == 1
    with KVServeClient(server.address) as client:
        assert client.get_session("cli-slash").turns == 1
    helped = subprocess.run(
        [sys.executable, "-m", "kvserve.clients.chat", "--help"],
        capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=60,
    )  # fmt: skip
    assert helped.returncode == 0 and "/edit MESSAGE" in helped.stdout and "//TEXT" in helped.stdout
