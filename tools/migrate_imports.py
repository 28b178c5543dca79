"""Rewrite pre-0.2 kvserve import names in Python files.

kvserve used to install three generic top-level packages, `service`, `cachestore` and
`clients`. They now install as `kvserve.service`, `kvserve.cachestore` and
`kvserve.clients` (the repository layout is unchanged). This rewrites import statements,
`python -m` module names and logger/module strings in the files given:

    python tools/migrate_imports.py my_app/*.py      # rewrite in place, list what changed
    python tools/migrate_imports.py --check src/*.py # exit 1 if anything would change
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

OLD = ("service", "cachestore", "clients")
_NAMES = "|".join(OLD)

_PATTERNS = (
    # `from service.x import y`, `import cachestore.codec as c` (any indentation)
    (re.compile(rf"^(\s*)(from|import)\s+({_NAMES})(?=[.\s])", re.M), r"\1\2 kvserve.\3"),
    # "-m", "kvserve.service" / "kvserve.service.cli" in argument lists; `python -m kvserve.service` in text
    (re.compile(rf"""(["']-m["'],\s*["'])({_NAMES})(?=[."'])"""), r"\1kvserve.\2"),
    (re.compile(rf"(-m\s+)({_NAMES})\b(?![-/])"), r"\1kvserve.\2"),
    # logger="kvserve.service.server", "kvserve.service.cli:main", "kvserve.clients.chat:main", mock targets
    (re.compile(rf"""(?<![\w./-])(["'])({_NAMES})\.(?!(?:name|version|instance|namespace)\b)(?=[a-z_])"""),
     r"\1kvserve.\2."),
)


def migrate(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    # never double-prefix what was already migrated
    return text.replace("kvserve.", "kvserve.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file would change")
    args = ap.parse_args(argv)
    changed = []
    for path in args.files:
        text = path.read_text()
        new = migrate(text)
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    for path in changed:
        print(f"{'would rewrite' if args.check else 'rewrote'} {path}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
