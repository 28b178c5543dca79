"""The first hour with kvserve (issue 26): startup errors are one line and come before
the model loads, a signal during startup stops it there, the process ends as soon as
it logs "stopped", and a drain that Redis (not the clock) cut short says so."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time

from kvserve.clients import KVServeClient
from kvserve.service.cli import main
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import REPO, ServerThread, start_server_process, subprocess_env, tiny_config


def serve_process(args: list[str]) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """``python -m kvserve.service ARGS`` with its stderr collected line by line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service", *args], cwd=REPO, env=subprocess_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    done = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, done


def wait_for_line(lines: list[str], text: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in lines):
            return True
        time.sleep(0.01)
    return False


def test_metrics_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # a model directory that does not exist: the port check must come first
        proc, lines, done = serve_process(["--model", str(tmp_path / "no-model"), "--host", "127.0.0.1", "--port", "0",
                                           "--metrics-port", str(port)])  # fmt: skip
        rc = proc.wait(120)
        done.wait(10)
    errors = [line for line in lines if "error" in line.lower()]
    assert rc == 2, "".join(lines)
    assert len(errors) == 1, "".join(lines)
    assert f"metrics port {port}" in errors[0] and "--metrics-port" in errors[0]
    assert "model" not in errors[0]


def test_ctrl_c_during_the_model_load_exits_130_without_serving(tiny_llama_dir):
    # Redis on a closed port: its DEGRADED warning is logged after the signal handlers
    # are in place and right before the model loads
    proc, lines, done = serve_process(["--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0",
                                       "--device", "cpu", "--redis-url", f"redis://127.0.0.1:{free_port()}"])  # fmt: skip
    assert wait_for_line(lines, "serving DEGRADED"), "".join(lines)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(60)
    done.wait(10)
    text = "".join(lines)
    assert rc == 130, text
    assert "SIGINT during startup: stopping before serving" in text
    assert "serving kvserve" not in text


def test_the_process_ends_when_it_has_stopped(tiny_llama_dir):
    proc, _port, lines = start_server_process(["--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0",
                                                "--device", "cpu", "--kv-cache-memory", "8MiB"])  # fmt: skip
    assert wait_for_line(lines, "security:")
    proc.send_signal(signal.SIGTERM)
    assert wait_for_line(lines, " stopped\n", timeout=60), "".join(lines)
    t0 = time.monotonic()
    rc = proc.wait(60)
    lingered = time.monotonic() - t0
    assert rc == 0
    assert lingered < 2.0, f"the process lingered {lingered:.1f} s after 'stopped'"  # was 2-12 s (teardown GC)


def test_a_bad_flag_value_is_one_line(capsys):
    try:
        main(["serve", "--port", "abc"])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--port" in err and "not an integer: 'abc'" in err and "--help" in err
    try:  # the same from the environment
        main(["config"], environ={"KVSERVE_PORT": "abc"})
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert err == "kvserve config: error: KVSERVE_PORT='abc': not an integer: 'abc' (kvserve config --help lists the flags)\n"


def test_config_refuses_the_keys_serve_refuses(capsys):
    try:
        code = main(["config", "--api-keys", "garbage"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvserve config: error: --api-keys") and err.count("\n") == 1


def test_a_drain_cut_short_by_redis_says_so(tiny_llama_dir, caplog):
    cfg = tiny_config(tiny_llama_dir, redis_url=f"redis://127.0.0.1:{free_port()}", host_cache_memory=0,
                      spill_after=3600.0, drain_timeout=2.0)  # fmt: skip
    caplog.set_level(logging.INFO, logger="kvserve.service.server")
    with ServerThread(cfg) as s:
        with KVServeClient(s.address, timeout=60) as c:
            c.complete(text="the quick brown fox jumps over the lazy dog " * 3, session_id="s1", max_new_tokens=4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drain:")]
    assert lines, [r.getMessage() for r in caplog.records]
    # The acknowledged turn waited for Redis as long as the drain allows, then is named as lost...
    turns = [ln for ln in lines if "acknowledged turn(s) not in Redis" in ln]
    assert turns and "lost with this process" in turns[0] and "--disk-cache-dir" in turns[0], lines
    # ...and the blocks that Redis did not take are counted as left, with the reason.
    blocks = [ln for ln in lines if "full block(s)" in ln]
    assert blocks and "left (Redis" in blocks[0], lines


# ----------------------------------------------------------------------------- kvserve-chat

CHAT_KEY = "first-hour-key"


def test_chat_address_without_a_port_means_50051():
    from kvserve.clients.chat import with_port

    assert with_port("localhost") == "localhost:50051"
    assert with_port("10.0.0.7") == "10.0.0.7:50051"
    assert with_port("[::1]") == "[::1]:50051" and with_port("::1") == "[::1]:50051"
    for kept in ("localhost:7000", "[::1]:7000", "dns:///kvserve.internal:7000", "unix:/tmp/kvserve.sock"):
        assert with_port(kept) == kept


def test_chat_help_is_plain_text(capsys):
    from kvserve.clients.chat import main as chat

    try:
        chat(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "kvserve-chat: chat with a kvserve server" in out
    assert "``" not in out


def test_chat_with_a_key_server(tiny_llama_dir, capsys):
    import io

    from kvserve.clients.chat import main as chat
    from kvserve.service.auth import hash_key

    cfg = tiny_config(tiny_llama_dir, api_keys=f"acme:{hash_key(CHAT_KEY)}")
    with ServerThread(cfg) as s:
        # without --token: the error says how to send the key
        assert chat(["--address", s.address, "--session", "fh-401"], stdin=io.StringIO("hi\n"), stdout=io.StringIO()) == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED" in err and "--token" in err
        # /undo, /regenerate, /edit before the first turn: said here, not a NOT_FOUND from the server
        out = io.StringIO()
        code = chat(["--address", s.address, "--session", "fh-cmds", "--token", CHAT_KEY],
                    stdin=io.StringIO("/undo\n/regenerate\n/edit hello\n"), stdout=out)  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1
        assert out.getvalue().startswith("[session fh-cmds: new]\n")
        assert err.count("has no turns yet") == 3, err
        assert "NOT_FOUND" not in err
