"""``kvserve``: the server's command line.

    kvserve serve [flags]          run the gRPC server (every flag also reads KVSERVE_*)
    kvserve config [flags]         print the effective settings (flags + environment)
    kvserve config --markdown      print the settings table (docs/configuration.md)
    kvserve hash-key [--tenant T] [KEY]
                                   print the stored (hashed) form of an API key read
                                   from stdin (or given as KEY); --generate makes a new key

``python -m kvserve.service [flags]`` is ``kvserve serve [flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Mapping, NoReturn, Sequence

from .config import ConfigError, ServerConfig, mask_url_password


class _Parser(argparse.ArgumentParser):
    """An error is one line: what is wrong and where the flags are listed (not the
    whole usage, which for ``serve`` is dozens of lines)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvserve",
        description="Streaming gRPC text generation with a durable, tiered KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the gRPC server",
        description="Run the kvserve gRPC server. Every flag can also be set with the "
        "KVSERVE_* environment variable named in its help; a flag wins over the variable.",
    )
    ServerConfig.argument_parser(serve)
    config = sub.add_parser("config", help="print the effective settings, or the settings table")
    config.add_argument("--markdown", action="store_true", help="print the settings table as Markdown")
    ServerConfig.argument_parser(config)
    hash_key = sub.add_parser(
        "hash-key",
        help="print the hashed form of an API key (a line of the --api-keys-file)",
        description="Read an API key from stdin (or take it as KEY, or --generate a new one) and print the line "
        "to put in the --api-keys-file: TENANT:SHA256HEX (just the hash without --tenant). The server stores only "
        "this hash.",
    )
    hash_key.add_argument(
        "key", nargs="?", metavar="KEY",
        help="the API key (default: read from stdin, which keeps it out of your shell history)",
    )  # fmt: skip
    hash_key.add_argument("--tenant", help="tenant the key belongs to (prints tenant:hash)")
    hash_key.add_argument("--generate", action="store_true", help="make a new random key and print it first")
    return parser


def _hash_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .auth import ApiKeysError, check_tenant, generate_key, hash_key

    if args.tenant is not None:
        try:
            check_tenant(args.tenant, "--tenant")
        except ApiKeysError as e:
            parser.error(str(e))
    if args.generate and args.key is not None:
        parser.error("give KEY or --generate, not both")
    if args.generate:
        key = generate_key()
        print(f"# the new API key (give it to the client; only its hash is stored):\n{key}")
    elif args.key is not None:
        key = args.key.strip()
        print(
            "kvserve hash-key: warning: a key given on the command line stays in your shell history; "
            "prefer: kvserve hash-key [--tenant T] < keyfile",
            file=sys.stderr,
        )
    else:
        if sys.stdin.isatty():
            print("kvserve hash-key: type the key and press Enter (it is not echoed back):", file=sys.stderr)
            import getpass

            key = getpass.getpass("").strip()
        else:
            key = sys.stdin.readline().strip()
    if not key:
        parser.error("no key: pass it on stdin (echo \"$KEY\" | kvserve hash-key), as KEY, or use --generate")
    digest = hash_key(key)
    print(f"{args.tenant}:{digest}" if args.tenant is not None else digest)
    return 0


def main(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, *, exit_now: bool | None = None
) -> int:
    """Run the command line; ``exit_now`` (default: when ``argv`` is the process's own,
    None): after ``serve`` end the process at once with its status, skipping the
    interpreter's teardown (seconds of garbage collection after "stopped", or a model
    load a signal interrupted still running in its thread)."""
    if exit_now is None:
        exit_now = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "hash-key":
        return _hash_key(args, parser)
    if args.command == "config" and args.markdown:
        print(ServerConfig.markdown_table(), end="")
        return 0
    settings = [a for a in argv[1:] if a != "--markdown"]
    try:
        config = ServerConfig.from_args(settings, environ)
    except ConfigError as e:
        _fail(args.command, str(e))
    if args.command == "config":
        from .auth import ApiKeysError, load_api_keys

        try:  # the keys as serve reads them: the same refusal
            load_api_keys(config.api_keys_file, config.api_keys)
        except ApiKeysError as e:
            _fail("config", str(e))
        print(config.describe())
        return 0
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger(__name__)
    log.info(
        "starting: model %s, device %s, port %s, redis %s (kvserve config prints every setting)",
        config.model or "(packaged default)", config.device, config.port, mask_url_password(config.redis_url),
    )  # fmt: skip
    log.debug("settings:\n%s", config.describe())
    from . import kernels  # torch-free: before torch loads

    kernels.passive_openmp()
    try:
        code = asyncio.run(_serve(config, exit_now))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are in place
        code = 130
    if exit_now:
        _exit(code)
    return code


def _exit(code: int) -> NoReturn:
    """End the process now with ``code``, the logs and output flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


async def _serve(config: ServerConfig, exit_now: bool = False) -> int:
    """Run the server; a failure is one line on stderr (what, where, what to do) and
    exit status 2 (configuration) or 1 (anything else); ``--log-level debug`` adds the
    traceback."""
    from .auth import ApiKeysError
    from .server import StartupError, run

    log = logging.getLogger(__name__)
    try:
        code = await run(config)
        if exit_now:  # the server is stopped: not even the event loop's teardown is left to wait for
            _exit(code)
        return code
    except (ConfigError, ApiKeysError, StartupError) as e:  # keys, TLS files, device, port, Redis, model
        log.debug("startup failed", exc_info=True)
        print(f"kvserve serve: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:
        log.debug("failed", exc_info=True)
        print(
            f"kvserve serve: error: {type(e).__name__}: {_one_line(str(e))} (--log-level debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _fail(command: str, message: str) -> NoReturn:
    print(f"kvserve {command}: error: {_one_line(message)} (kvserve {command} --help lists the flags)", file=sys.stderr)
    sys.exit(2)


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
