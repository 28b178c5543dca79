"""The docs stay true to the code: commands, flags, environment variables, metrics, links.

* Every ``--flag`` in the README and docs is a flag of the command it follows
  (``kvserve serve`` / ``python -m kvserve.service`` -> ``ServerConfig``; ``kvserve-chat``, the
  bench scripts, the Node client -> their own argument parsers) and, anywhere else, a flag
  of some command of this repository or of a listed external tool.
* Every ``KVSERVE_*`` variable is a ``ServerConfig`` setting.
* Every ``kvserve_*`` metric named in docs/metrics.md is exported by a live server (with
  host and Redis tiers, after real turns), and every exported family is documented.
* Every relative link resolves to a file (and a heading, for ``#anchors`` into Markdown),
  and the README links every page of docs/.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.clients import KVServeClient
from kvserve.service.config import ServerConfig, env_name, flag_name, negative_flag_name
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import REPO, ServerThread, tiny_config

DOCS = sorted((REPO / "docs").glob("*.md"))
README = REPO / "README.md"
PAGES = [
    README,
    *DOCS,
    REPO / "clients" / "node" / "README.md",
    REPO / "service" / "default_model" / "README.md",
]

FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
ENV_RE = re.compile(r"\bKVSERVE_[A-Z][A-Z0-9_]*")
METRIC_RE = re.compile(r"\bkvserve_[a-z][a-z0-9_]*")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)

SERVER_FLAGS = frozenset(flag_name(f.name) for f in dataclasses.fields(ServerConfig)) | frozenset(
    n for f in dataclasses.fields(ServerConfig) if (n := negative_flag_name(f.name))
)
SERVER_ENV = frozenset(env_name(f.name) for f in dataclasses.fields(ServerConfig))

# Flags of other programs that the docs show, by program. A flag of one of these that the
# docs start using must be added here deliberately.
EXTERNAL_FLAGS = {
    "buf curl": {
        "--protocol",
        "--http2-prior-knowledge",
        "--data",
        "--list-methods",
        "--schema",
        "--header",
    },
    "python -m dynamo.indexer": {"--port", "--workers", "--block-size"},  # docs/deploy.md: Dynamo's KV indexer
    # docs/deploy.md: the routers tests/system/test_routers.py runs (their launch flags)
    "sglang-router launch / vllm-router": {
        "--worker-urls", "--policy", "--prometheus-port", "--cache-threshold", "--balance-abs-threshold",
        "--balance-rel-threshold", "--assignment-mode", "--health-check-interval-secs", "--health-failure-threshold",
        "--cb-failure-threshold", "--kv-event-source", "--api-key",
    },
    "docker / docker compose": {
        "--build",
        "--build-arg",
        "--profile",
        "--scale",
        "--gpus",
        "--rm",
        "--file",
    },
    "redis-server / redis-cli": {
        "--port",
        "--save",
        "--appendonly",
        "--cluster",
        "--cluster-replicas",
        "--cluster-enabled",
    },
    "pip / pytest / npm": {"--no-binary", "--no-deps", "--quiet", "--index-url"},
    "llama.cpp's llama-server (bench/bench_restore.py --llama-bin)": {"--cache-ram", "--slot-save-path"},
    "py-spy record (profiling a server)": {"--gil"},
}


def _py_flags(*paths: Path) -> set[str]:
    """``--flags`` declared with ``add_argument`` in these Python files."""
    out: set[str] = set()
    for path in paths:
        out |= set(
            re.findall(r"add_argument\(\s*[\"'](--[a-z0-9-]+)", path.read_text())
        )
    return out


def _node_flags() -> set[str]:
    """Options of clients/node/index.js (``parseArgs``)."""
    js = (REPO / "clients" / "node" / "index.js").read_text()
    options = re.search(r"options:\s*\{(.*?)\n\s{4}\},", js, re.DOTALL)
    assert options, "parseArgs options not found in clients/node/index.js"
    return {
        "--" + k
        for k in re.findall(
            r"^\s+'?([a-z][a-z-]*)'?:\s*\{\s*type:", options.group(1), re.MULTILINE
        )
    }


def _command_flags() -> dict[str, set[str]]:
    """Command pattern -> the flags it takes."""
    cli = REPO / "service" / "cli.py"
    commands: dict[str, set[str]] = {
        r"kvserve serve|python -m kvserve.service(?![.\w])": set(SERVER_FLAGS),
        r"kvserve config": SERVER_FLAGS | {"--markdown"},
        r"kvserve hash-key": _py_flags(cli) - {"--markdown"},
        r"kvserve-chat": _py_flags(REPO / "clients" / "chat.py"),
        r"node index\.js": _node_flags(),
        r"grpc_health_probe\.py": _py_flags(REPO / "deploy" / "grpc_health_probe.py"),
        r"buf curl": EXTERNAL_FLAGS["buf curl"],
    }
    for script in sorted((REPO / "bench").glob("*.py")) + sorted(
        (REPO / "tools").glob("*.py")
    ):
        commands[re.escape(f"{script.parent.name}/{script.name}")] = _py_flags(
            script
        ) | {"--help"}
    for script in sorted((REPO / "bench").glob("*.sh")):  # options it compares "$1" with
        commands[re.escape(f"{script.parent.name}/{script.name}")] = set(
            re.findall(r'= "(--[a-z][a-z-]*)"', script.read_text())
        )
    return commands


def _known_flags(commands: dict[str, set[str]]) -> set[str]:
    known = set().union(*commands.values())
    for flags in EXTERNAL_FLAGS.values():
        known |= flags
    return known


def _command_lines(text: str) -> list[str]:
    """Lines with shell continuations (``\\`` at the end) joined."""
    return text.replace("\\\n", " ").splitlines()


def test_readme_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# kvserve")
    first_block = lines[
        lines.index("```sh") + 1 : lines.index("```", lines.index("```sh") + 1)
    ]
    assert lines.index("```sh") <= 4, (
        "the two commands come right after the title and one line"
    )
    assert first_block == [
        "pip install torch==2.13.0 -e . && kvserve serve",
        "bash .ci/run",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -q -e '.[test]'" in ci and "pytest" in ci.splitlines()[-1]
    # in a fresh virtualenv (the test extra alone, not this image's packages), torch first
    venv, torch, extra = (ci.index(s) for s in ('python3 -m venv "$venv"', "pip install -q torch==2.13.0",
                                                  "pip install -q -e '.[test]'"))  # fmt: skip
    assert venv < ci.index('. "$venv/bin/activate"') < torch < extra
    assert 'kvserve = "kvserve.service.cli:main"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_flags_exist(page: Path):
    commands = _command_flags()
    known = _known_flags(commands)
    text = page.read_text()
    unknown = sorted(set(FLAG_RE.findall(text)) - known)
    assert not unknown, (
        f"{page.name}: flags no command of this repository (nor a listed tool) has: {unknown}"
    )
    wrong = []
    for line in _command_lines(text):
        for pattern, flags in commands.items():
            for m in re.finditer(rf"(?:{pattern})\b([^`|;&\n]*)", line):
                wrong += [
                    (m.group(0).split()[0:2], f)
                    for f in FLAG_RE.findall(m.group(1))
                    if f not in flags
                ]
    assert not wrong, (
        f"{page.name}: flags given to a command that does not take them: {wrong}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_environment_variables_exist(page: Path):
    unknown = sorted(set(ENV_RE.findall(page.read_text())) - SERVER_ENV)
    assert not unknown, f"{page.name}: not ServerConfig settings: {unknown}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


ROW_ANCHOR_RE = re.compile(r'<a (?:id|name)="([^"]+)"></a>')


def _anchors(page: Path) -> set[str]:
    """A page's link targets: its headings' anchors and its ``<a id="...">`` (a table row's)."""
    text = FENCE_RE.sub("", page.read_text())
    headings = {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+)$", text, re.MULTILINE)}
    return headings | set(ROW_ANCHOR_RE.findall(text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK_RE.findall(FENCE_RE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


BENCHMARKS = REPO / "docs" / "benchmarks.md"


def _benchmark_rows() -> dict[str, str]:
    """Row anchor -> its table row, in docs/benchmarks.md."""
    rows = {}
    for line in BENCHMARKS.read_text().splitlines():
        for anchor in ROW_ANCHOR_RE.findall(line):
            assert anchor not in rows, f"benchmarks.md: anchor {anchor!r} twice"
            rows[anchor] = line
    return rows


@pytest.mark.parametrize("page", [README, REPO / "docs" / "architecture.md"], ids=lambda p: p.name)
def test_headline_figures_link_their_benchmark_row(page: Path):
    """A figure README.md or architecture.md quotes links the row of docs/benchmarks.md it
    comes from: every link there into benchmarks.md names a row's anchor (README's table of
    pages aside), and that anchor exists."""
    rows = _benchmark_rows()
    bad = []
    for line in FENCE_RE.sub("", page.read_text()).splitlines():
        for target in LINK_RE.findall(line):
            path, _, anchor = target.partition("#")
            if not path.endswith("benchmarks.md"):
                continue
            if not anchor and line.startswith("| [docs/benchmarks.md]"):
                continue  # the Documentation table
            if anchor not in rows:
                bad.append(target)
    assert not bad, f"{page.name}: links into benchmarks.md that name no row: {bad}"


def test_benchmarks_is_a_page_of_current_figures():
    """docs/benchmarks.md stays short (its history lives in benchmarks-log.md), and every
    row of a figures table names its machine (one of the page's machines table) and date."""
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) < 400, "benchmarks.md: move history to benchmarks-log.md"
    machines = set(re.findall(r"^\| \*\*(\w+)\*\* \|", text, re.MULTILINE))
    assert {"zen3", "zen4", "h200"} <= machines
    tables = re.findall(r"((?:^\|.*\n)+)", text, re.MULTILINE)
    checked = 0
    for table in tables:
        header, _, *body = table.splitlines()
        cells = [c.strip() for c in header.strip("|").split("|")]
        if "machine, date" not in cells:
            continue
        col = cells.index("machine, date")
        for line in body:
            cell = line.strip("|").split("|")[col]
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", cell), f"no date: {line}"
            assert any(m in cell for m in machines) or "host" in cell, f"no machine: {line}"
            checked += 1
    assert checked >= 50


def test_readme_links_every_doc():
    readme = README.read_text()
    missing = [p.name for p in DOCS if f"](docs/{p.name})" not in readme]
    assert not missing, (
        f"README.md does not link {missing}: add them to its Documentation table"
    )


def _documented_metrics() -> set[str]:
    return set(METRIC_RE.findall((REPO / "docs" / "metrics.md").read_text()))


def test_every_documented_metric_is_exported_and_every_family_documented(
    tiny_llama_dir, redis_url
):
    cfg = tiny_config(
        tiny_llama_dir,
        redis_url=redis_url,
        host_cache_memory=1 << 20,
        metrics_port=free_port(),
        spill_after=0.05,
        kv_events_endpoint="tcp://127.0.0.1:*",
    )
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as client:
        client.chat("docs", "hello there", max_new_tokens=6)
        reply = client.chat("docs", "and again", max_new_tokens=6)
        assert reply.start.cached_tokens > 0
        url = f"http://127.0.0.1:{srv.running.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as resp:
            scrape = resp.read().decode()
    families = [
        f
        for f in text_string_to_metric_families(scrape)
        if f.name.startswith("kvserve_")
    ]
    exported = {f.name for f in families} | {
        s.name for f in families for s in f.samples
    }
    # declared families (# TYPE lines) count even when they have no sample yet
    exported |= set(re.findall(r"^# TYPE (kvserve_\w+) ", scrape, re.MULTILINE))
    documented = _documented_metrics()
    assert documented, "docs/metrics.md names no metric"
    assert not documented - exported, (
        f"documented but not exported: {sorted(documented - exported)}"
    )
    undocumented = sorted(
        f.name
        for f in families
        if not f.name.endswith("_created")
        and not {f.name, f.name + "_total"} & documented
    )
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"


def test_the_architecture_diagram_is_drawn_from_the_code():
    """docs/architecture.md's flowchart: every box inside a package's subgraph names a
    file (or a folder) of that package that defines each name the box lists, and every
    arrow joins two boxes that exist, so a moved file or a renamed class fails here."""
    text = (REPO / "docs" / "architecture.md").read_text()
    chart = text[text.index("```mermaid\nflowchart LR\n"):]
    chart = chart[: chart.index("\n```")]
    folder, boxes, arrows, checked = None, set(), [], 0
    for line in chart.splitlines()[2:]:
        line = line.strip()
        if m := re.fullmatch(r'subgraph \w+\["(\S+/) \(kvserve\.\w+\)"\]', line):
            folder = REPO / m.group(1)
            continue
        if line == "end":
            folder = None
            continue
        if m := re.fullmatch(r'(\w+)\["([^"<]+)<br/>([^"]+)"\]', line):
            assert folder is not None, f"a box outside every package: {line}"
            box, path, names = m.group(1), folder / m.group(2), [n.strip() for n in m.group(3).split(",")]
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path, path.with_suffix(".pyi")]
            assert path.exists(), f"{line}: {path.relative_to(REPO)} does not exist"
            source = "\n".join(f.read_text() for f in files if f.exists())
            for name in names:
                assert re.search(rf"^\s*(class|def|async def) {name}\b|^{name} = ", source, re.M), (
                    f"{line}: {name} is not defined in {path.relative_to(REPO)}")
                checked += 1
            boxes.add(box)
            continue
        if m := re.fullmatch(r'(\w+)(\(\[[^\]]*\]\))? --> (\w+)', line):  # a([caller]) --> box, or box --> box
            arrows.append((line, None if m.group(2) else m.group(1), m.group(3)))
            continue
        assert not line, f"a line the check does not read: {line}"
    for line, a, b in arrows:
        assert a is None or a in boxes, f"{line}: no box {a}"
        assert b in boxes, f"{line}: no box {b}"
    assert checked > 30 and {"stubs", "breaker", "tiers", "store", "servicer"} <= boxes
