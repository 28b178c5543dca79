"""``kvserve-chat``: chat with a kvserve server in a server-side session.

    kvserve-chat --address localhost:50051 [--session NAME]

Each line read from stdin is one user message; the reply is streamed as it is
generated, then a line with the cache and timing figures of the turn::

    [cached 48/61 prompt tokens (device) · ttft 12 ms · 35.2 tok/s]

Commands: ``/regenerate [TEMPERATURE]`` answers the last message again, replacing the
last answer (at ``--temperature``, or 1.0 when the chat is greedy: a greedy answer
would come out the same; a number after it sets the temperature), ``/edit MESSAGE``
replaces the last message and answers it, ``/undo`` drops the last turn (its KV stays
cached: asking again restores it), ``/fork NAME`` branches the conversation into a new
session NAME and continues there, ``/reset`` deletes the session and starts a new one,
``/help`` lists the commands, ``/quit`` (or end of input) exits. Any other line starting
with ``/`` is refused as an unknown command (a mistyped command is never sent to the
model); start a message with ``//`` to send one that begins with ``/``. ``/regenerate``, ``/edit`` and ``/undo`` name the
turn count the chat knows (expected_turns), so a turn another client added meanwhile
is never replaced or dropped: the command fails, the chat reads the session again, and
the same command then applies to the session as it is. ``--session NAME`` resumes that session (default: a new random id);
a resumed session is warmed up (WarmSession: the server restores its KV blocks into its
device pool while the first message is typed; with stdin from a pipe, before it is sent).
``--tools FILE`` (a JSON list of OpenAI tools) offers functions to the model and
``--tool-choice`` (auto, required, none or a function's name) says how it calls them; a
reply's calls are printed as ``[tool call NAME ARGUMENTS (id ID)]`` and the next line is
sent as every call's result (a ``tool`` message per call): a tool loop in the session.
Works with stdin from a pipe (no prompt is printed when stdin is not a terminal).
Ctrl-C during a reply cancels that turn (the session is left as before the turn).
Follow-up turns demand the existing session: if the server no longer has its history
(expired, deleted, lost), the chat says so and starts the session over.
Exit status: 0, or 1 when the last turn or command failed (its gRPC status, or what was
wrong with the command, is printed on stderr) or the session could not be looked up.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from typing import Sequence, TextIO

import grpc

from .client import KVServeClient, KVServeError, StreamEnd, StreamStart, TextDelta


COMMANDS = """\
commands (typed on a line of their own):
  /regenerate [TEMPERATURE]  answer the last message again, replacing the answer
                             (at --temperature, or 1.0 when the chat is greedy)
  /edit MESSAGE              replace the last message and answer it
  /undo                      drop the last turn (its KV stays cached)
  /fork NAME                 branch into a new session NAME (no KV copied) and go on there
  /reset                     delete the session and start a new one
  /help                      this list
  /quit                      exit (as does end of input); Ctrl-C cancels a reply
  //TEXT                     send the message /TEXT (a line starting with / is a command)
"""
_NO_ARGUMENT = ("/undo", "/reset", "/help", "/quit")


DEFAULT_PORT = 50051


def with_port(address: str) -> str:
    """``host`` -> ``host:50051`` (gRPC would otherwise try port 443); an address with a
    port, an IPv6 one in brackets with a port, or a gRPC target URI (``dns:///...``,
    ``unix:...``) is left as it is."""
    if "://" in address or address.startswith(("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{DEFAULT_PORT}"
    return address if ":" in address else f"{address}:{DEFAULT_PORT}"


def _error_line(e: KVServeError) -> str:
    """A failed call for the chat's user: the status, its details and, for a missing or
    wrong key, the flag that sends one."""
    if e.code == grpc.StatusCode.UNAUTHENTICATED:
        return f"[error UNAUTHENTICATED: the server wants an API key: pass it with --token KEY ({e.details})]\n"
    return f"[error {e.code.name}: {e.details}]\n"


def _stats_line(start: StreamStart, end: StreamEnd, ttft_s: float | None) -> str:
    tier = f" ({start.cached_tier})" if start.cached_tokens else ""
    parts = [f"cached {start.cached_tokens}/{start.prompt_tokens} prompt tokens{tier}"]
    if ttft_s is not None:
        parts.append(f"ttft {ttft_s * 1000:.0f} ms")
    parts.append(f"{end.timings.decode_tokens_per_s:.1f} tok/s")
    if end.finish_reason != "stop":
        parts.append(end.finish_reason)
    return "[" + " · ".join(parts) + "]"


def _turn(
    client: KVServeClient, session: str, message: str | None, args: argparse.Namespace, out: TextIO,
    existing: bool = False, turn_mode: str = "append", temperature: float | None = None,
    expected_turns: int | None = None, calls: list | None = None,
) -> bool:  # fmt: skip
    """One streamed turn; False if it was cancelled (Ctrl-C: the session is as before).
    ``calls``: the previous reply's tool calls, which ``message`` answers; replaced by
    this reply's."""
    sent = time.perf_counter()
    ttft: float | None = None
    start: StreamStart | None = None
    pending = calls if calls is not None else []
    if message is None:
        messages = None
    elif pending and turn_mode == "append":
        messages = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": message} for c in pending]
    else:
        messages = [{"role": "user", "content": message}]
    tools = getattr(args, "tools", None)
    stream = client.generate(
        messages=messages,
        tools=tools,
        tool_choice=getattr(args, "tool_choice", None) if tools else None,
        session_id=session,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature if temperature is None else temperature,
        timeout=args.timeout,
        require_existing_session=existing and turn_mode == "append",
        turn_mode=turn_mode,
        expected_turns=expected_turns,
    )
    try:
        for event in stream:
            if isinstance(event, StreamStart):
                start = event
            elif isinstance(event, TextDelta):
                if ttft is None and event.token_ids:
                    ttft = time.perf_counter() - sent
                out.write(event.text)
                out.flush()
            elif start is not None:
                for c in event.tool_calls:
                    out.write(f"\n[tool call {c.name} {c.arguments} (id {c.id})]")
                out.write("\n" + _stats_line(start, event, ttft) + "\n")
                out.flush()
                if calls is not None:
                    calls[:] = event.tool_calls
    except KeyboardInterrupt:
        stream.cancel()
        out.write("\n[cancelled]\n")
        out.flush()
        return False
    return True


def _session_command(
    client: KVServeClient, session: str, turns: int, command: str, rest: str, args: argparse.Namespace,
    out: TextIO, err: TextIO,
) -> int | None:  # fmt: skip
    """``/regenerate``, ``/edit``, ``/undo`` or ``/fork`` on a session this chat knows to
    have ``turns`` turns (sent as expected_turns: a turn another client added meanwhile is
    never replaced or dropped). Returns the session's turns after it (the new session's
    for ``/fork``), or None (the error printed) if it failed."""
    try:
        if command == "/regenerate":
            try:
                temperature = float(rest) if rest else (args.temperature or 1.0)
            except ValueError:
                err.write(f"[usage: /regenerate [TEMPERATURE], got {rest!r}]\n")
                return None
            _turn(client, session, None, args, out, turn_mode="regenerate", temperature=temperature,
                  expected_turns=turns)  # fmt: skip
        elif command == "/edit":
            if not rest:
                err.write("[usage: /edit MESSAGE]\n")
                return None
            _turn(client, session, rest, args, out, turn_mode="edit", expected_turns=turns)
        elif command == "/undo":
            info, dropped = client.rewind_session(session, 1, expected_turns=turns)
            turns = info.turns
            out.write(f"[session {session}: undid the last turn ({dropped} tokens); {info.turns} turns, "
                      f"{info.token_count} tokens]\n")  # fmt: skip
        else:
            if not rest:
                err.write("[usage: /fork NAME]\n")
                return None
            info = client.fork_session(session, rest)
            turns = info.turns
            out.write(f"[session {rest}: forked from {session} at turn {info.turns}, {info.token_count} tokens "
                      f"({info.cached_blocks['device']}/{info.full_blocks} blocks shared on the device)]\n")  # fmt: skip
    except KVServeError as e:
        err.write(_error_line(e))
        err.flush()
        return None
    out.flush()
    return turns


def _turns_now(client: KVServeClient, session: str, turns: int) -> int:
    try:
        return client.get_session(session).turns
    except KVServeError:
        return turns


def _warm(client: KVServeClient, session: str, *, background: bool) -> None:
    """WarmSession for a resumed session: best effort (a server without it, or one that
    cannot, changes nothing but the next turn's speed), in a thread while the user types."""

    def warm() -> None:
        try:
            client.warm_session(session)
        except KVServeError:
            pass

    if background:
        threading.Thread(target=warm, name="kvserve-chat-warm", daemon=True).start()
    else:
        warm()


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvserve-chat", description=__doc__.splitlines()[0].replace("``", ""), epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--address", default=f"localhost:{DEFAULT_PORT}",
                        help=f"server host:port; a host alone means port {DEFAULT_PORT} (default: %(default)s)")  # fmt: skip
    parser.add_argument("--session", default=None, help="session to resume or create (default: a new random id)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="reply length limit (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each turn in seconds")
    parser.add_argument("--token", default=None, help="API key (for a server with --api-keys), sent as a bearer token")
    parser.add_argument("--tools", default=None, metavar="FILE",
                        help="JSON file of tools (OpenAI's list) the model may call")  # fmt: skip
    parser.add_argument("--tool-choice", default=None, help="with --tools: auto, required, none or a function's name")
    args = parser.parse_args(argv)
    if args.tools is not None:
        try:
            with open(args.tools, encoding="utf-8") as f:
                args.tools = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--tools {args.tools}: {e}")
        if not isinstance(args.tools, list):
            parser.error("--tools must hold a JSON list of tools")
    elif args.tool_choice is not None:
        parser.error("--tool-choice needs --tools")
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    err = sys.stderr
    interactive = stdin.isatty()
    session = args.session or f"chat-{uuid.uuid4().hex[:12]}"

    pending_calls: list = []  # the last reply's tool calls: the next line is their result
    has_history = False  # the session has completed turns: later turns demand it exists
    turns = 0  # the session's completed turns, as far as this chat knows
    with KVServeClient(with_port(args.address), token=args.token) as client:
        try:
            info = client.get_session(session)
            out.write(f"[session {session}: resumed, {info.turns} turns, {info.token_count} tokens]\n")
            has_history, turns = True, info.turns
            _warm(client, session, background=interactive)
        except KVServeError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                err.write(_error_line(e))
                return 1
            out.write(f"[session {session}: new]\n")
        out.flush()
        last_failed = False
        while True:
            if interactive:
                out.write("you> ")
                out.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                out.write("\n")
                break
            if not line:
                break
            message = line.strip()
            if not message:
                continue
            command, _, rest = message.partition(" ")
            rest = rest.strip()
            if message.startswith("//"):
                message, command = message[1:], ""  # a message that begins with /
            elif command in _NO_ARGUMENT and rest:
                err.write(f"[usage: {command} takes no argument, got {rest!r}]\n")
                err.flush()
                last_failed = True
                continue
            elif message.startswith("/") and command not in ("/regenerate", "/edit", "/fork") + _NO_ARGUMENT:
                err.write(f"[unknown command {command}: /help lists the commands; start a message with // "
                          f"to send one that begins with /]\n")  # fmt: skip
                err.flush()
                last_failed = True
                continue
            if command == "/quit":
                break
            if command == "/help":
                out.write(COMMANDS)
                out.flush()
                continue
            if command in ("/regenerate", "/edit", "/undo") and turns == 0:
                err.write(f"[{command}: session {session} has no turns yet; send a message first]\n")
                err.flush()
                last_failed = True
                continue
            if command in ("/regenerate", "/edit", "/undo", "/fork", "/reset"):
                pending_calls.clear()  # the next line is a user message again
            if command in ("/regenerate", "/edit", "/undo", "/fork"):
                after = _session_command(client, session, turns, command, rest, args, out, err)
                last_failed = after is None
                if after is None:  # another client may have changed the session: learn its turns
                    turns = _turns_now(client, session, turns)
                else:
                    turns = after
                    if command == "/fork":
                        session, has_history = rest, True
                continue
            if command == "/reset":
                try:
                    client.delete_session(session)
                except KVServeError as e:
                    if e.code != grpc.StatusCode.NOT_FOUND:
                        err.write(_error_line(e))
                session = f"chat-{uuid.uuid4().hex[:12]}"
                out.write(f"[session {session}: new]\n")
                out.flush()
                has_history, turns = False, 0
                continue
            try:
                try:
                    done = _turn(client, session, message, args, out, existing=has_history, calls=pending_calls)
                except KVServeError as e:
                    if not (has_history and e.code == grpc.StatusCode.NOT_FOUND):
                        raise
                    out.write(f"[session {session}: the server no longer has its history "
                              f"(expired, deleted or lost); starting it over]\n")  # fmt: skip
                    turns = 0
                    pending_calls.clear()
                    done = _turn(client, session, message, args, out, calls=pending_calls)
                if done:
                    has_history, turns = True, turns + 1
                last_failed = False
            except KVServeError as e:
                last_failed = True
                err.write(_error_line(e))
                err.flush()
    return 1 if last_failed else 0


if __name__ == "__main__":
    sys.exit(main())
