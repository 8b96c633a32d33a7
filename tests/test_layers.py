"""The layers, read from the imports: an arrow that points the wrong way is a failing test.

Every ``import`` and ``from ... import`` of ``src/nvpair`` counts, at module level or inside
a function, under ``TYPE_CHECKING`` too, and so does ``importlib.import_module("...")``
(``__import__``) with a literal name: what Python would import, the ``ast`` says, without
importing anything. The folders of ``src/nvpair`` are the layers, listed lowest first in
``RANKS``: a module imports only from its own folder or from folders before it, so no import
runs up and no two folders import each other. Data goes ``config -> supervision -> state ->
http``: supervision writes the snapshot and the API reads it; the two meet only in what sits
below both (``state/``).

To check another tree (an old commit, a branch)::

    mkdir -p /tmp/old && git archive 6172395 src/nvpair | tar -x -C /tmp/old
    python -m tests.test_layers --root /tmp/old/src --flat
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

#: the folders, lowest first: a module imports only from its own folder or from folders
#: before it (prefixes: a package covers its modules). A new folder must be placed here.
RANKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("nvpair.errors", "nvpair.base")),
    ("runtime", ("nvpair.runtime",)),
    ("config", ("nvpair.config",)),
    ("state", ("nvpair.state",)),
    ("probing", ("nvpair.probing",)),
    ("supervision", ("nvpair.supervision",)),
    ("http", ("nvpair.http",)),
    ("router", ("nvpair.router",)),
    ("peers", ("nvpair.peers",)),
    ("service", ("nvpair.service", "nvpair.openapi")),
    ("cli", ("nvpair.__main__", "nvpair.cli")),
)
#: a program of its own (``python -m nvpair.sim``): outside the ranks, see the sim rules.
SIM = "nvpair.sim"

SUPERVISION = ("nvpair.probing", "nvpair.supervision")
PURE_CONFIG = ("nvpair.config", "nvpair.base.decoding", "nvpair.errors")
#: where each module of the flat layout before the folders (issue 32) lives now: to read an
#: old tree (``--flat``) with today's rules
FLAT: dict[str, str] = {
    "nvpair.ages": "nvpair.base.ages", "nvpair.boundary": "nvpair.base.boundary",
    "nvpair.changes": "nvpair.base.changes", "nvpair.decoding": "nvpair.base.decoding",
    "nvpair.histogram": "nvpair.base.histogram", "nvpair.logs": "nvpair.base.logs",
    "nvpair.streams": "nvpair.base.streams", "nvpair.tls": "nvpair.base.tls",
    "nvpair.urls": "nvpair.base.urls", "nvpair.wakes": "nvpair.runtime.wakes",
    "nvpair.collector": "nvpair.runtime.collector", "nvpair.looplag": "nvpair.runtime.looplag",
    "nvpair.config": "nvpair.config.settings", "nvpair.manifest": "nvpair.config.manifest",
    "nvpair.command": "nvpair.config.command", "nvpair.cluster": "nvpair.config.cluster",
    "nvpair.schema": "nvpair.config.schema", "nvpair.group.spec": "nvpair.config.group",
    "nvpair.deploy": "nvpair.config.deploy", "nvpair.snapshot": "nvpair.state.snapshot",
    "nvpair.state": "nvpair.state.transitions", "nvpair.traffic": "nvpair.state.traffic",
    "nvpair.listing": "nvpair.state.listing", "nvpair.events": "nvpair.state.events",
    "nvpair.history": "nvpair.state.history", "nvpair.memstate": "nvpair.state.memory",
    "nvpair.group.machine": "nvpair.state.group", "nvpair.probes": "nvpair.probing.probes",
    "nvpair.prober": "nvpair.probing.prober", "nvpair.sweep": "nvpair.probing.sweep",
    "nvpair.oneshot": "nvpair.probing.oneshot", "nvpair.answer": "nvpair.probing.answer",
    "nvpair.process": "nvpair.supervision.process",
    "nvpair.lifecycle": "nvpair.supervision.lifecycle",
    "nvpair.orphans": "nvpair.supervision.orphans",
    "nvpair.memwatch": "nvpair.supervision.memwatch",
    "nvpair.memproc": "nvpair.supervision.memproc",
    "nvpair.memtrend": "nvpair.supervision.memtrend",
    "nvpair.group.runner": "nvpair.supervision.group", "nvpair.server": "nvpair.http.server",
    "nvpair.asgi": "nvpair.http.asgi", "nvpair.api": "nvpair.http.api",
    "nvpair.views": "nvpair.http.views", "nvpair.control": "nvpair.http.control",
    "nvpair.sse": "nvpair.http.sse", "nvpair.metrics": "nvpair.http.metrics",
    "nvpair.dashboard": "nvpair.http.dashboard", "nvpair.group.view": "nvpair.http.groups",
    "nvpair.ui": "nvpair.http.ui", "nvpair.evict": "nvpair.router.evict",
    "nvpair.router.view": "nvpair.router.counters", "nvpair.group.link": "nvpair.peers.groups",
    "nvpair.group.epochkey": "nvpair.peers.epochkey",
    "nvpair.supervisor": "nvpair.supervision.supervisor",
}

IO_LIBRARIES = ("trio", "httpx2", "httpcore2")


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str  # a module of the tree, or an outside one (trio, httpx2._models, ...)
    line: int
    by_name: bool = False  # importlib.import_module("...") or __import__("...")

    def __str__(self) -> str:
        how = " by name (importlib)" if self.by_name else ""
        return f"{self.source}:{self.line} imports {self.target}{how}"


@dataclass
class Graph:
    modules: set[str] = field(default_factory=set)
    arrows: dict[str, list[Arrow]] = field(default_factory=dict)

    def internal(self, name: str) -> bool:
        return name in self.modules

    def out(self, module: str) -> list[Arrow]:
        return self.arrows.get(module, [])


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def renamed(name: str, names: dict[str, str]) -> str:
    """``name`` as it is called in ``names`` (a module or anything inside it)."""
    for old, new in sorted(names.items(), key=lambda kv: -len(kv[0])):
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def read_graph(root: Path, names: dict[str, str] | None = None) -> Graph:
    """The import graph of the ``nvpair`` package under ``root`` (a ``src`` directory), its
    modules called as in ``names`` (old name -> new) where given."""
    graph = _read_graph(root)
    if not names:
        return graph
    out = Graph()
    out.modules = {renamed(m, names) for m in graph.modules}
    for m, arrows in graph.arrows.items():
        out.arrows[renamed(m, names)] = [
            Arrow(renamed(a.source, names), renamed(a.target, names), a.line, a.by_name)
            for a in arrows]
    return out


def _read_graph(root: Path) -> Graph:
    graph = Graph()
    files = sorted((root / "nvpair").rglob("*.py"))
    graph.modules = {module_name(p, root) for p in files}
    for path in files:
        name = module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph.arrows[name] = list(_arrows(ast.parse(path.read_bytes(), str(path)), name,
                                          package, graph.modules))
    return graph


def _arrows(tree: ast.AST, name: str, package: str, modules: set[str]) -> Iterator[Arrow]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Arrow(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:  # `from nvpair import views` imports nvpair.http.views
                sub = f"{base}.{alias.name}"
                yield Arrow(name, sub if sub in modules else base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _callee(node.func) in ("import_module", "importlib.import_module",
                                         "__import__")):
            yield Arrow(name, node.args[0].value, node.lineno, by_name=True)


def _callee(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def rank(name: str) -> int | None:
    for i, (_, prefixes) in enumerate(RANKS):
        if under(name, prefixes):
            return i
    return None


def _parents(name: str) -> Iterator[str]:
    """The packages Python imports first (``nvpair.router.peering``: ``nvpair.router``)."""
    parts = name.split(".")
    for i in range(2, len(parts)):
        yield ".".join(parts[:i])


@dataclass(frozen=True)
class Rule:
    name: str
    sources: tuple[str, ...]
    forbidden: tuple[str, ...]
    #: follow imports through the tree (an arrow through a third module counts too)
    transitive: bool = True
    #: module -> the forbidden prefixes it alone may import, and why (see the module)
    allowed: tuple[tuple[str, str], ...] = ()
    exempt: tuple[str, ...] = ()  # sources the rule does not apply to
    xfail: str | None = None  # a known wrong arrow, named, with who removes it

    def violations(self, graph: Graph) -> list[str]:
        found: list[str] = []
        starts = sorted(m for m in graph.modules if under(m, self.sources)
                        and not under(m, self.exempt))
        for start in starts:
            seen = {start}
            paths = {start: [start]}
            todo = [start]
            while todo:
                module = todo.pop()
                for arrow in graph.out(module):
                    target = arrow.target
                    if under(target, self.forbidden) and not any(
                            module == m and under(target, (p,)) for m, p in self.allowed):
                        found.append(" -> ".join([*paths[module][:-1], str(arrow)]))
                        continue
                    if not self.transitive or not graph.internal(target):
                        continue
                    for nxt in (*_parents(target), target):
                        if nxt not in seen and graph.internal(nxt):
                            seen.add(nxt)
                            paths[nxt] = [*paths[module], nxt]
                            todo.append(nxt)
        return sorted(set(found))


RULES: tuple[Rule, ...] = (
    Rule("api never imports supervision",
         sources=("nvpair.http.api", "nvpair.http.views", "nvpair.http.asgi"),
         forbidden=SUPERVISION),
    Rule("config, manifest, decoding, errors and command import no trio, httpx2, httpcore2",
         sources=PURE_CONFIG, forbidden=IO_LIBRARIES,
         allowed=(("nvpair.base.urls", "httpx2"),)),  # httpx2.URL: the clients' URL parser, no I/O
    Rule("supervision imports no asgi, views, api, router or control",
         sources=SUPERVISION,
         forbidden=("nvpair.http.asgi", "nvpair.http.views", "nvpair.http.api", "nvpair.router",
                    "nvpair.http.control", "nvpair.peers", "nvpair.service")),
    Rule("peers import no api, control or views", sources=("nvpair.peers",),
         forbidden=("nvpair.http.api", "nvpair.http.control", "nvpair.http.views",
                    "nvpair.service")),
    Rule("router imports no peers", sources=("nvpair.router",), forbidden=("nvpair.peers",)),
    Rule("only the cli imports the simulators", sources=("nvpair",), forbidden=(SIM,),
         exempt=(SIM, "nvpair.cli"), transitive=False),
)


def sim_violations(graph: Graph) -> list[str]:
    """The simulators import nothing of nvpair outside ``nvpair.sim``: they stand for the
    engines, so they must not share code with what probes them."""
    return sorted({str(a) for m in graph.modules if under(m, (SIM,)) for a in graph.out(m)
                   if under(a.target, ("nvpair",)) and not under(a.target, (SIM,))})


def rank_violations(graph: Graph) -> list[str]:
    """Each arrow points down the ranks (or stays in its rank); every module has a rank."""
    found = []
    for module in sorted(graph.modules):
        if module == "nvpair" or under(module, (SIM,)):
            continue
        mine = rank(module)
        if mine is None:
            found.append(f"{module} has no rank: place it in RANKS (tests/test_layers.py)")
            continue
        for arrow in graph.out(module):
            theirs = rank(arrow.target)
            if theirs is not None and theirs > mine:
                found.append(f"{arrow} ({RANKS[mine][0]} -> {RANKS[theirs][0]}, "
                             "an arrow up the ranks)")
    return sorted(set(found))


def folder(module: str) -> str:
    """The folder a module is in (``nvpair.state.snapshot``: ``nvpair.state``), or the
    module itself at the top (``nvpair.service``)."""
    return ".".join(module.split(".")[:2])


def folder_cycles(graph: Graph) -> list[str]:
    """Folders that import each other, through any number of folders between them."""
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        for arrow in graph.out(module):
            if graph.internal(arrow.target) and folder(arrow.target) != folder(module):
                edges.setdefault(folder(module), set()).add(folder(arrow.target))
    found = set()
    for start in edges:
        todo, seen = [start], set()
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt == start:
                    found.add(start)
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return sorted(f"{f} imports itself through other folders" for f in found)


def by_name_violations(graph: Graph) -> list[str]:
    """Imports of nvpair modules by a string hide the arrow from static checks (and this
    test reads them anyway): write them as import statements."""
    return sorted({str(a) for arrows in graph.arrows.values() for a in arrows
                   if a.by_name and under(a.target, ("nvpair",))})


def all_violations(root: Path, names: dict[str, str] | None = None) -> dict[str, list[str]]:
    graph = read_graph(root, names)
    out = {r.name: r.violations(graph) for r in RULES}
    out["sim imports nothing of nvpair outside nvpair.sim"] = sim_violations(graph)
    out["imports point down the ranks"] = rank_violations(graph)
    out["no nvpair module is imported by name"] = by_name_violations(graph)
    out["no folder imports itself through others"] = folder_cycles(graph)
    return out


@pytest.fixture(scope="module")
def graph() -> Graph:
    return read_graph(SRC)


def test_the_graph_is_the_package(graph: Graph) -> None:
    assert {"nvpair.http.api", "nvpair.config.settings", "nvpair.peers.table",
            "nvpair.sim.cli"} <= graph.modules
    assert len(graph.modules) > 60
    assert any(a.target == "trio" for a in graph.out("nvpair.state.snapshot"))


def _param(rule: Rule) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=rule.xfail)] if rule.xfail else []
    return pytest.param(rule, id=rule.name, marks=marks)


@pytest.mark.parametrize("rule", [_param(r) for r in RULES])
def test_never(rule: Rule, graph: Graph) -> None:
    assert rule.violations(graph) == [], rule.name


def test_sim_imports_nothing_of_nvpair_outside_it(graph: Graph) -> None:
    assert sim_violations(graph) == []


def test_imports_point_down_the_ranks(graph: Graph) -> None:
    assert rank_violations(graph) == []


def test_no_two_folders_import_each_other(graph: Graph) -> None:
    assert folder_cycles(graph) == []


def test_a_cycle_between_folders_is_found() -> None:
    graph = Graph(modules={"nvpair.a.x", "nvpair.b.y", "nvpair.c.z"})
    graph.arrows = {"nvpair.a.x": [Arrow("nvpair.a.x", "nvpair.b.y", 1)],
                    "nvpair.b.y": [Arrow("nvpair.b.y", "nvpair.c.z", 1)],
                    "nvpair.c.z": [Arrow("nvpair.c.z", "nvpair.a.x", 1)]}
    assert folder_cycles(graph) == [f"nvpair.{f} imports itself through other folders"
                                    for f in "abc"]


def test_every_folder_is_a_layer(graph: Graph) -> None:
    """Each folder of the package (but the simulators, a program of their own) is ranked."""
    folders = {folder(m) for m in graph.modules if m.count(".") >= 2}
    ranked = {p for _, prefixes in RANKS for p in prefixes}
    assert folders - ranked - {SIM} == set()


def test_no_nvpair_module_is_imported_by_name(graph: Graph) -> None:
    assert by_name_violations(graph) == []


OLD = "6172395"  # the imports as the structure review read them (issue 14)


def test_the_rules_fail_on_the_imports_of_6172395(tmp_path: Path) -> None:
    """Each arrow issue 14 names, in the tree of commit 6172395, breaks a rule."""
    git = shutil.which("git")
    repo = SRC.parent
    if git is None or subprocess.run([git, "-C", str(repo), "cat-file", "-e", OLD],
                                     capture_output=True).returncode != 0:
        pytest.skip(f"commit {OLD} is not in this checkout")
    archive = subprocess.run([git, "-C", str(repo), "archive", OLD, "src/nvpair"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    found = all_violations(tmp_path / "src", FLAT)
    text = "\n".join(f"{rule}: {v}" for rule, vs in found.items() for v in vs)
    for rule, arrow in [
        ("imports point down the ranks", "nvpair.config.settings:32 imports nvpair.peers.settings"),
        ("supervision imports no asgi",
         "nvpair.probing.prober:21 imports nvpair.router.traffic"),
        ("supervision imports no asgi",
         "nvpair.supervision.supervisor:12 imports nvpair.router.traffic"),
        ("supervision imports no asgi",
         "nvpair.supervision.lifecycle:26 imports nvpair.http.asgi"),
        ("supervision imports no asgi",
         "nvpair.supervision.lifecycle:36 imports nvpair.http.views"),
        ("supervision imports no asgi",
         "nvpair.supervision.lifecycle:32 imports nvpair.router.traffic"),
        ("peers import no api", "nvpair.peers.broker:12 imports nvpair.http.api"),
        ("peers import no api", "nvpair.peers.advert:17 imports nvpair.http.views"),
        ("peers import no api", "nvpair.peers.table:27 imports nvpair.http.views"),
        ("peers import no api", "nvpair.peers.etcd:38 imports nvpair.http.views"),
        ("router imports no peers", "nvpair.router.select:9 imports nvpair.peers.table"),
        ("router imports no peers", "nvpair.router.relay:39 imports nvpair.peers.table"),
        ("no nvpair module is imported by name",
         "nvpair.cli.main:77 imports nvpair.sim.cli by name"),
    ]:
        assert any(line.startswith(rule) and arrow in line for line in text.splitlines()), (
            rule, arrow, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.test_layers",
                                     description="check the layers of a source tree")
    parser.add_argument("--root", type=Path, default=SRC,
                        help="the src directory that holds nvpair/ (default: this checkout)")
    parser.add_argument("--flat", action="store_true",
                        help="the tree has the flat layout of before issue 32 (read it by FLAT)")
    args = parser.parse_args(argv)
    failed = 0
    for rule, found in all_violations(args.root, FLAT if args.flat else None).items():
        print(f"{'FAIL' if found else 'ok  '} {rule}")
        for line in found:
            print(f"       {line}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
