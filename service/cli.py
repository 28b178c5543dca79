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
from typing import Mapping, Sequence

from kvserve.service.config import ConfigError, ServerConfig, mask_url_password


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    from kvserve.service.auth import ApiKeysError, check_tenant, generate_key, hash_key

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


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
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
        parser.error(str(e))  # exits 2
    if args.command == "config":
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
    from kvserve.service.models import native  # torch-free: before torch loads

    native.passive_openmp()
    try:
        return asyncio.run(_serve(config))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are in place
        return 130


async def _serve(config: ServerConfig) -> int:
    """Run the server; a failure is one line on stderr (what, where, what to do) and
    exit status 2 (configuration) or 1 (anything else); ``--log-level debug`` adds the
    traceback."""
    from kvserve.service.auth import ApiKeysError
    from kvserve.service.server import StartupError, run

    log = logging.getLogger(__name__)
    try:
        return await run(config)
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


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
