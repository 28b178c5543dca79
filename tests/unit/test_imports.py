"""What must import without torch: the domain types (the front and the clients name them
without loading the engine) and the Python clients with their generated stubs."""

from __future__ import annotations

import subprocess
import sys

from tests.fixtures.serving import REPO, subprocess_env

_NO_TORCH = "import sys; sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"


def _runs_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + code], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _absolute(path, node) -> str:
    """The absolute module an ``ast.ImportFrom`` in ``path`` names: the packages import
    each other relatively (``from ..types import X`` in service/engine/), resolved here
    as Python does, from the file's place under the repository (kvserve.<folder>...)."""
    if not node.level:
        return node.module or ""
    package = ["kvserve", *path.relative_to(REPO).parts[:-1]]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _from_imports(path, tree, skip=frozenset()) -> list[str]:
    """Every ``from X import a`` of ``path`` as absolute modules: X, or X.a where X is a
    package whose module ``a`` is imported (``from . import ops``)."""
    import ast

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in skip:
            mod = _absolute(path, node)
            out.extend([mod] if node.module else [f"{mod}.{a.name}" for a in node.names])
    return out


def test_the_blocker_works():
    assert _runs_without_torch("import kvserve.service.engine").returncode != 0


def test_domain_types_import_without_torch():
    out = _runs_without_torch("import kvserve.service.types as t; assert t.SamplingParams().max_new_tokens > 0")
    assert out.returncode == 0, out.stderr


def test_tool_calling_imports_without_torch_or_grpc():
    """service/tools is pure Python (the Responses API and tests reuse it without the engine)."""
    out = _runs_without_torch("sys.modules['grpc'] = None\nimport kvserve.service.tools as t; assert t.FAMILIES")
    assert out.returncode == 0, out.stderr


def test_clients_and_their_stubs_import_without_torch_or_the_server():
    code = (
        "import kvserve.clients, kvserve.clients.chat\n"
        "from kvserve.proto.kvserve.v1 import generation_pb2\n"
        "assert not [m for m in sys.modules if m.startswith(('kvserve.service', 'kvserve.cachestore'))]\n"
    )
    out = _runs_without_torch(code)
    assert out.returncode == 0, out.stderr


def test_the_stubs_are_shared_and_the_server_never_imports_the_clients():
    """The generated stubs are kvserve.proto's (proto/, beside the .proto files): the server
    and the clients both import them from there, so service/ and cachestore/ never import
    kvserve.clients (a server that needs the clients' code would ship a client inside it);
    the clients import the stubs and nothing else of kvserve; the stubs import nothing of
    kvserve but each other."""
    for root in ("service", "cachestore"):
        for path, names in _package_imports(root).items():
            bad = [m for m in names if m.startswith("kvserve.clients")]
            assert not bad, f"{path} imports the clients: {bad}"
    servicer = _imports(REPO / "service" / "servicer.py")
    assert "kvserve.proto.kvserve.v1.generation_pb2_grpc" in servicer, servicer
    for path, names in _package_imports("clients").items():
        bad = [m for m in names if m.startswith("kvserve.") and not m.startswith(("kvserve.clients", "kvserve.proto"))]
        assert not bad, f"{path} imports more than the stubs: {bad}"
    assert "kvserve.proto.kvserve.v1.generation_pb2" in _imports(REPO / "clients" / "client.py")
    for path, names in _package_imports("proto").items():
        bad = [m for m in names if m.startswith("kvserve.") and not m.startswith("kvserve.proto")]
        assert not bad, f"{path} imports {bad}"
    assert not (REPO / "clients" / "_proto").exists()


def _package_imports(root: str) -> dict[str, list[str]]:
    """Every import of each module under ``root`` (run time and TYPE_CHECKING alike)."""
    return {str(p.relative_to(REPO)): _imports(p) for p in (REPO / root).rglob("*.py")
            if not {"build", "node", "node_modules", "__pycache__"} & set(p.relative_to(REPO).parts)}


def test_what_service_and_cachestore_share_lives_in_common():
    """kvserve.common holds what both sides need (the tier names, the circuit breaker,
    the directory lock) and imports nothing of kvserve and nothing outside the standard
    library; the cache store imports nothing of the service; the session layer
    (service/sessions/) and the settings and domain types use common's names and import
    nothing of kvserve.cachestore, so neither side reaches into the other for them."""
    for path, names in _package_imports("common").items():
        bad = [m for m in names if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("kvserve.common")]
        assert not bad, f"{path} imports {bad}"
    for path, names in _package_imports("cachestore").items():
        bad = [m for m in names if m.startswith(("kvserve.service", "kvserve.clients", "kvserve.proto"))]
        assert not bad, f"{path} imports the service: {bad}"
    users = {**_package_imports("service/sessions"),
             **{f"service/{n}.py": _imports(REPO / "service" / f"{n}.py") for n in ("types", "config", "server")}}
    for path, names in users.items():
        bad = [m for m in names if m.startswith("kvserve.cachestore") and not m.startswith("kvserve.cachestore.tiered.")]
        assert not bad, f"{path} imports the cache store's modules: {bad}"
    assert "kvserve.common.breaker.CircuitBreaker" in _imports(REPO / "service" / "sessions" / "stores" / "fallback.py")
    assert "kvserve.common.breaker.CircuitBreaker" in _imports(REPO / "cachestore" / "redis.py")
    assert "kvserve.common.tiers.Tier" in _imports(REPO / "service" / "types.py")
    # what docs/architecture.md says: types.py names the store's stats for type checkers only
    assert [m for m in _imports(REPO / "service" / "types.py") if m.startswith("kvserve.cachestore")] == [
        "kvserve.cachestore.tiered.TieredStats"]
    assert not [m for m in _module_imports(REPO / "service" / "types.py") if m.startswith("kvserve.cachestore")]
    assert not (REPO / "cachestore" / "breaker.py").exists()
    out = _runs_without_torch("import kvserve.common.breaker, kvserve.common.tiers, kvserve.common.dirlock\n"
                              "import kvserve.service.sessions\n"
                              "assert not [m for m in sys.modules if m.startswith('kvserve.cachestore')], sys.modules")
    assert out.returncode == 0, out.stderr


def test_the_front_names_no_engine_or_store_internals():
    """servicer, wire and conversations talk to the engine through AsyncEngine's methods
    (imported for type checking only) and to the store not at all."""
    import ast

    for name in ("servicer", "wire", "conversations"):
        tree = ast.parse((REPO / "service" / f"{name}.py").read_text())
        type_checking = {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        imported = _from_imports(REPO / "service" / f"{name}.py", tree, type_checking)
        inner = [m for m in imported if m.startswith(("kvserve.cachestore", "kvserve.service.engine", "kvserve.service.kv", "torch"))]
        assert not inner, f"service/{name}.py imports {inner}"
        source = (REPO / "service" / f"{name}.py").read_text()
        inside = [s for s in (".engine.engine", ".engine.store", "TieredStore", "cachestore") if s in source]
        assert not inside, f"service/{name}.py reaches into the engine or the KV store: {inside}"


def _module_imports(path) -> list[str]:
    """kvserve modules ``path`` imports at run time (not under TYPE_CHECKING)."""
    import ast

    tree = ast.parse(path.read_text())
    type_checking = {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(path, node)
            out.extend([mod] if node.module else [f"{mod}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m.startswith("kvserve.")]


ENGINE = REPO / "service" / "engine"
ROOMS = ("scheduler", "restore", "runner", "output")


def test_the_engine_rooms_import_in_one_direction():
    """engine.py composes the rooms; no room imports another room, the engine or its
    asyncio front; what they share (sequence.py, config.py, sampling/grammar for the
    output room, kv/) imports no room; BlockKeys imports nothing of the engine."""
    rooms = {f"kvserve.service.engine.{r}" for r in ROOMS}
    above = rooms | {"kvserve.service.engine.engine", "kvserve.service.engine.async_engine"}
    for name in (*ROOMS, "sequence", "config", "sampling", "grammar", "speculative"):
        own = f"kvserve.service.engine.{name}"
        bad = [m for m in _module_imports(ENGINE / f"{name}.py") if m in above - {own}]
        assert not bad, f"service/engine/{name}.py imports {bad}"
    assert rooms <= set(_module_imports(ENGINE / "engine.py"))
    keys = _module_imports(REPO / "service" / "kv" / "keys.py")
    assert not [m for m in keys if m.startswith("kvserve.service.engine")], keys
    front = _module_imports(ENGINE / "async_engine.py")
    assert not [m for m in front if m in rooms], f"async_engine.py imports a room: {front}"


def test_block_keys_are_derived_in_one_place():
    """Namespaces and block chains come from service/kv/keys.py (BlockKeys) alone: no
    other service module imports or calls cachestore.keys' derivations (``block_hashes``
    is also a field name of the KV events wire format, service/kv_events.py)."""
    import re

    derive = re.compile(r"\b(block_hashes|make_namespace)\s*\(|import[^\n]*\b(block_hashes|make_namespace)\b")
    for path in (REPO / "service").rglob("*.py"):
        if path == REPO / "service" / "kv" / "keys.py":
            continue
        assert not derive.search(path.read_text()), f"{path} derives block keys"


def test_async_engine_reads_no_engine_attribute():
    """AsyncEngine only hops threads: every use of its LLMEngine (``self.engine``, or a
    local bound to it) is one of LLMEngine's public methods, called or handed to a
    thread; never a state attribute (blocks, pool, store, grammars, accepting, ...)."""
    import ast

    cls = next(n for n in ast.parse((ENGINE / "engine.py").read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    methods = {
        f.name for f in cls.body
        if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
        and not any("property" in ast.unparse(d) for d in f.decorator_list)
    }
    assert {"step", "cache_stats", "forget_stored", "block_locations", "spill"} <= methods
    tree = ast.parse((ENGINE / "async_engine.py").read_text())

    def is_engine(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "engine" and ast.unparse(node.value) == "self"

    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_engine(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and (is_engine(n.value) or (isinstance(n.value, ast.Name) and n.value.id in aliases))]
    assert uses, "the check found no use of the engine"
    bad = sorted({f"{ast.unparse(n)} (line {n.lineno})" for n in uses if n.attr not in methods})
    assert not bad, f"AsyncEngine reads LLMEngine attributes: {bad}"
    stores = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and (is_engine(t.value) or ast.unparse(t.value) in aliases)]
    assert not stores, "AsyncEngine sets an LLMEngine attribute"
    assert "getattr(" not in ast.unparse(tree)


def _imports(path) -> list[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = [f"{_absolute(path, n)}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             for a in n.names]  # fmt: skip
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return names


def test_the_kernels_import_nothing_from_the_models_or_the_engine():
    """service/kernels/ knows arrays, never modules: the model code hands it typed views
    of its weights, so the arrow goes models -> kernels and never back."""
    files = sorted((REPO / "service" / "kernels").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "build.py", "binding.py", "ops.py", "layer.py"}
    for f in files:
        inner = [m for m in _imports(f) if m.startswith("kvserve.") and not m.startswith("kvserve.service.kernels")]
        assert not inner, f"service/kernels/{f.name} imports {inner}"


def test_the_kernels_loader_and_build_import_without_torch():
    """setup.py loads build.py by path before anything is installed; the command line
    sets OpenMP's wait policy through the loader before torch loads."""
    out = _runs_without_torch("from kvserve.service import kernels\nfrom kvserve.service.kernels import build, binding\n"
                              "kernels.passive_openmp(); binding.header_binding()\n")
    assert out.returncode == 0, out.stderr
    assert all(m.split(".")[0] in sys.stdlib_module_names or m.startswith("kvserve.service.kernels")
               for m in _imports(REPO / "service" / "kernels" / "build.py")), "build.py: standard library only"


def test_a_checkout_reads_its_own_imports():
    """Static tools read a checkout as it is: inside each package (service/, cachestore/,
    clients/, proto/, common/) imports are relative, so each names a file by its place; across packages
    they are absolute (kvserve.cachestore...), and kvserve/ at the root maps those names
    to the folders with one symbolic link each (the installed names; no __path__ code)."""
    import ast

    for root in ("service", "cachestore", "clients", "proto", "common"):
        link = REPO / "kvserve" / root
        assert link.is_symlink() and link.resolve() == (REPO / root).resolve(), link
    assert not (REPO / "kvserve" / "__init__.py").exists()
    checked = 0
    for root in ("service", "cachestore", "clients", "proto", "common"):
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).parts
            if {"build", "node", "node_modules"} & set(parts):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                mod = _absolute(path, node)
                assert node.level or not mod.startswith(f"kvserve.{root}"), (
                    f"{path.relative_to(REPO)}:{node.lineno} imports its own package absolutely: {mod}")
                if not mod.startswith("kvserve."):
                    continue
                target = REPO.joinpath(*mod.split(".")[1:])
                names = [] if node.module else [a.name for a in node.names]
                found = (target.with_suffix(".py").exists() or (target / "__init__.py").exists()
                         or target.with_suffix(".pyi").exists())
                assert found or all((target / f"{n}.py").exists() for n in names), (
                    f"{path.relative_to(REPO)}:{node.lineno}: {mod} names no file of the checkout")
                checked += 1
    assert checked > 200, checked


def _service_modules() -> dict[str, object]:
    """Every module under service/ by its absolute name (a package by its own name)."""
    out = {}
    for path in (REPO / "service").rglob("*.py"):
        if {"build", "__pycache__"} & set(path.relative_to(REPO).parts):
            continue
        parts = ["kvserve", *path.relative_to(REPO).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _service_graph() -> dict[str, set[str]]:
    """service/'s modules and the service modules each imports: at module level, under
    TYPE_CHECKING and inside functions alike (an import moved into a function to dodge a
    circle is still an arrow)."""
    import ast

    modules = _service_modules()
    graph = {}
    for name, path in modules.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = _absolute(path, node)
                for a in node.names:
                    out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


# Circles left in service/, each with its reason; none may be added: the CUDA step,
# which step.py loads (inside its builder) only on CUDA, names step.py's GraphConfig.
KNOWN_CYCLES = {
    frozenset({"kvserve.service.models.cuda_step", "kvserve.service.models.step"}),
}


def test_no_import_cycle_inside_service():
    """No two modules of service/ import each other, directly or around a circle (the
    strongly connected parts of the import graph), but the circle listed above."""
    graph = _service_graph()
    assert "kvserve.service.http.responses" in graph["kvserve.service.http.app"]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(frozenset(part))

    for v in graph:
        if v not in index:
            visit(v)
    bad = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not bad, f"import circles inside service/: {bad}"


FRONTS = ("servicer.py", "wire.py", "http")


def _front_files() -> list:
    return [p for f in FRONTS for p in ([REPO / "service" / f] if f.endswith(".py") else
                                        sorted((REPO / "service" / f).glob("*.py")))]  # fmt: skip


def test_the_fronts_import_nothing_of_the_sessions_or_the_engine():
    """The fronts (the gRPC servicer, wire.py, service/http/) are translations over the
    conversation and the turn prologue (service/turns.py): they import nothing of the
    session table, the engine, the KV pool, the models or the store, not even for type
    checking, and never reach them through an attribute (``conversations.engine``,
    ``conversations.sessions``); session errors are the domain's (service/errors.py)."""
    import ast

    inner = ("kvserve.service.sessions", "kvserve.service.engine", "kvserve.service.kv", "kvserve.service.models",
             "kvserve.cachestore")  # fmt: skip
    files = _front_files()
    assert len(files) >= 7, files
    for path in files:
        bad = [m for m in _imports(path) if m.startswith(inner)]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"
        reach = [f"{ast.unparse(n)} (line {n.lineno})" for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Attribute) and n.attr in ("engine", "sessions")]  # fmt: skip
        assert not reach, f"{path.relative_to(REPO)} reaches past the conversation: {reach}"
    assert "kvserve.service.turns.Turns" in _imports(REPO / "service" / "servicer.py")
    assert "kvserve.service.turns.Turns" in _imports(REPO / "service" / "http" / "plumbing.py")


TURN_CALLS = ("run_turn", "prepare", "stream", "release")


def test_the_fronts_run_a_turn_through_turns_only():
    """A front runs a turn through the fronts' one prologue (``Turns``: ``start``,
    ``prompt_tokens``), never the conversation's turn calls itself (``prepare``,
    ``stream``, ``release``, ``run_turn``): a request enters ``conversations.py`` twice,
    both from ``turns.py`` (tests/service/test_request_path.py traces it)."""
    import ast

    for path in _front_files():
        calls = [f"{ast.unparse(n)} (line {n.lineno})" for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in TURN_CALLS
                 and ast.unparse(n.func.value).split(".")[-1] == "conversations"]  # fmt: skip
        assert not calls, f"{path.relative_to(REPO)} runs a turn past Turns: {calls}"
    turns = (REPO / "service" / "turns.py").read_text()
    assert "self.conversations.prepare(" in turns and "self.conversations.stream(" in turns


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_members(tree) -> set[str]:
    """The private names a module defines: its own functions, classes and globals, its
    classes' methods and attributes, and what it sets on ``self``/``cls``."""
    import ast

    out = set()
    bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")):  # fmt: skip
            out.add(node.attr)
    return {n for n in out if _private(n)}


# Private names of other libraries that a module of ours also happens to define.
FOREIGN_PRIVATE = {("service/engine/async_engine.py", "_queue")}  # asyncio.Queue's deque: a peek at what waits


def test_no_private_member_is_used_across_files():
    """A module of service/ uses no private (``_name``) member that another module of
    kvserve defines and it does not: no ``other._member``, no ``import _name`` (as far as
    a static reading can tell: a use through ``self``, ``cls`` or ``super()`` is the
    class's own, or its base's, and is left alone)."""
    import ast

    trees = {p: ast.parse(p.read_text()) for root in ("service", "cachestore", "common")
             for p in (REPO / root).rglob("*.py") if not {"build", "__pycache__"} & set(p.relative_to(REPO).parts)}  # fmt: skip
    own = {p: _private_members(t) for p, t in trees.items()}
    bad, checked = [], 0
    for path, tree in trees.items():
        rel = str(path.relative_to(REPO))
        if not rel.startswith("service/"):
            continue
        elsewhere = set().union(*(names for q, names in own.items() if q != path)) - own[path]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                checked += 1
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Call) and ast.unparse(v.func) == "super":
                    continue
                if node.attr in elsewhere and (rel, node.attr) not in FOREIGN_PRIVATE:
                    bad.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvserve.")):
                bad.extend(f"{rel}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name))
    assert checked > 500, checked
    assert not bad, f"private members used across files: {bad}"
