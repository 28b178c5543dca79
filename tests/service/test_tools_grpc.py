"""Tool calling over gRPC (GenerateRequest.tools / tool_choice, DeltaEvent.tool_calls,
FinalEvent.tool_calls, tool-result messages) with the Python client: the same outputs
and cache figures as the OpenAI client on the HTTP front, and a tool loop in a session
whose tool-result turns find every full block of the previous step cached, from the
device and, after a restart, from Redis."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvserve.clients import KVServeClient, KVServeError
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, wait_until
from tests.system.test_node_client import node_client  # noqa: F401 - fixture
from tests.service.test_tools_http import ASK, SCHEMAS, TOOLS, _model, client, config, fallback_dir  # noqa: F401 - fixture

STEPS = 3


def _result(step: int) -> str:
    return json.dumps({"step": step, "ok": True})


def test_grpc_streams_tool_call_pieces_and_the_final_event_has_the_calls(fallback_dir):
    with ServerThread(config(fallback_dir)) as s, KVServeClient(s.address, timeout=120) as g:
        events = list(g.generate(messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=2,
                                 max_new_tokens=300, parallel_tool_calls=False))  # fmt: skip
        end = events[-1]
        assert end.finish_reason == "tool_calls" and len(end.tool_calls) == 1
        pieces = [p for e in events[1:-1] for p in e.tool_calls]
        assert pieces[0].id == end.tool_calls[0].id and pieces[0].name == end.tool_calls[0].name
        assert "".join(p.arguments for p in pieces) == end.tool_calls[0].arguments
        assert all(not p.name for p in pieces[1:]) and len(pieces) > 2  # arguments in fragments
        assert "".join(e.text for e in events[1:-1]) == ""  # the reply is the call: no text outside it
        call = end.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        named = g.complete(messages=ASK, tools=TOOLS, tool_choice="get_time", max_new_tokens=300)
        assert [c.name for c in named.tool_calls] == ["get_time"]
        with pytest.raises(KVServeError, match="not in tools"):
            g.complete(messages=ASK, tools=TOOLS, tool_choice="nope", max_new_tokens=8)
        with pytest.raises(KVServeError, match="tools need chat messages"):
            g.complete(text="hi", tools=TOOLS, max_new_tokens=8)


def test_tool_loop_grpc_equals_http_from_the_device_then_redis_after_a_restart(fallback_dir, redis_url):
    """Steps 1-2 on one server (device hits), step 3 on a restarted one (Redis hits): the
    gRPC session (only the new messages each step) and the HTTP session (the whole
    history, X-Session-Id) get the same calls, prompt tokens and cached tokens, each in
    its own cache namespace; every full block of the previous step is cached."""
    cfg = config(fallback_dir, redis_url=redis_url, host_cache_memory=0, spill_after=0.05, spill_to=("redis",),
                 restore_policy="always")  # fmt: skip
    grpc_out, http_out = [], []
    g_new: list[dict] = list(ASK)  # the gRPC turn's new messages
    history: list[dict] = list(ASK)  # the HTTP request's messages

    def step(s: ServerThread, k: int) -> None:
        nonlocal g_new
        with KVServeClient(s.address, timeout=120) as g, client(s) as c:
            gr = g.complete(messages=g_new, session_id="g", cache_salt="grpc", tools=TOOLS, tool_choice="required",
                            max_new_tokens=300)  # fmt: skip
            hr = c.chat.completions.create(model=_model(c), messages=history, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=300, extra_headers={"X-Session-Id": "h"},
                                           extra_body={"cache_salt": "http"})  # fmt: skip
            msg = hr.choices[0].message
            assert hr.kvserve["history_diverged_at"] is None
            grpc_out.append(([(t.name, t.arguments) for t in gr.tool_calls], gr.end.finish_reason,
                             gr.start.prompt_tokens, gr.start.cached_tokens, gr.start.cached_by_tier,
                             gr.end.completion_tokens))  # fmt: skip
            tiers = hr.usage.prompt_tokens_details.model_extra["kvserve_cached_by_tier"]
            http_out.append(([(t.function.name, t.function.arguments) for t in msg.tool_calls],
                             hr.choices[0].finish_reason, hr.usage.prompt_tokens,
                             hr.usage.prompt_tokens_details.cached_tokens, tiers, hr.usage.completion_tokens))  # fmt: skip
            history.append(msg.model_dump(exclude_none=True))
            g_new = []
            for gc, hc in zip(gr.tool_calls, msg.tool_calls):
                g_new.append({"role": "tool", "tool_call_id": gc.id, "content": _result(k)})
                history.append({"role": "tool", "tool_call_id": hc.id, "content": _result(k)})
            assert wait_until(lambda: all(
                g.get_session(sid).cached_blocks.get("redis", 0) == g.get_session(sid).full_blocks for sid in "gh"
            ), timeout=30)  # fmt: skip

    with ServerThread(cfg, http_port=0) as s:
        step(s, 0)
        step(s, 1)
    with ServerThread(cfg, http_port=0) as s:  # restarted: the device is empty, Redis holds the sessions
        step(s, 2)
    assert http_out == grpc_out
    for k in (1, 2):
        calls, reason, prompt, cached, tiers, _ = grpc_out[k]
        prev_total = grpc_out[k - 1][2] + grpc_out[k - 1][5]  # the previous step's prompt and reply
        assert reason == "tool_calls" and calls
        assert prompt > prev_total and cached >= prev_total // BLOCK_SIZE * BLOCK_SIZE
    assert grpc_out[1][4]["device"] == grpc_out[1][3]  # step 2 from the device
    assert grpc_out[2][4]["redis"] == grpc_out[2][3]  # step 3 from Redis


def test_node_client_runs_a_tool_loop(fallback_dir, node_client):
    """clients/node with --tools and --tool-choice required: each reply's calls are
    printed, the next --message is their result, and that turn finds the previous
    step cached."""
    import re
    import subprocess

    from tests.system.test_node_client import TURN_FIGURES

    argv = node_client
    with ServerThread(config(fallback_dir)) as s:
        result = subprocess.run(
            [*argv, "--address", s.address, "--session", "node-tools", "--max-new-tokens", "300",
             "--tools", json.dumps(TOOLS), "--tool-choice", "required",
             "--message", ASK[1]["content"], "--message", _result(0), "--message", _result(1)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        calls = re.findall(r"^\[turn (\d)\] tool_call (\S+) (.*) \(id (\S+)\)$", result.stdout, re.M)
        assert {int(t) for t, *_ in calls} == {1, 2, 3}, result.stdout
        for _, name, args, _ in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        figures = {int(n): dict(kv.split("=", 1) for kv in line.split()) for n, line in TURN_FIGURES.findall(result.stdout)}
        for k in (2, 3):
            prev = int(figures[k - 1]["prompt_tokens"]) + int(figures[k - 1]["completion_tokens"])
            assert figures[k]["finish_reason"] == "tool_calls"
            assert int(figures[k]["cached_tokens"]) >= prev // BLOCK_SIZE * BLOCK_SIZE


def test_kvserve_chat_runs_a_tool_loop(fallback_dir, tmp_path):
    """kvserve-chat --tools --tool-choice required: calls are printed and the next line
    answers them; the session's next turn finds the previous step cached."""
    import io
    import re

    from kvserve.clients.chat import main

    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    with ServerThread(config(fallback_dir, default_max_new_tokens=300)) as s:
        out = io.StringIO()
        lines = io.StringIO(ASK[1]["content"] + "\n" + _result(0) + "\n")
        rc = main(["--address", s.address, "--session", "chat-tools", "--tools", str(tmp_path / "tools.json"),
                   "--tool-choice", "required"], stdin=lines, stdout=out)  # fmt: skip
        text = out.getvalue()
        assert rc == 0, text
        calls = re.findall(r"^\[tool call (\S+) (.*) \(id (\S+)\)\]$", text, re.M)
        assert len(calls) >= 2, text
        for name, args, _ in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        cached = [int(c) for c in re.findall(r"\[cached (\d+)/\d+ prompt tokens", text)]
        assert cached[0] == 0 and cached[1] > 0
        with KVServeClient(s.address) as g:
            info = g.get_session("chat-tools", include_turns=True)
        assert info.turns == 2 and cached[1] >= (info.turn_log[0].input_tokens + info.turn_log[0].output_tokens) // BLOCK_SIZE * BLOCK_SIZE
