"""The layers, read from the imports: an arrow that points the wrong way is a failing test.

Every ``import`` and ``from ... import`` of ``src/nvpair`` counts, at module level or inside
a function, under ``TYPE_CHECKING`` too, and so does ``importlib.import_module("...")``
(``__import__``) with a literal name: what Python would import, the ``ast`` says, without
importing anything. Data goes ``config -> manifest -> supervision -> snapshot -> api``:
supervision writes the snapshot and the API reads it. Imports point the other way, down the
ranks in ``RANKS``: a module imports only modules of its own rank or lower, so supervision
and the API meet only in what sits below both (the snapshot, the state machine, traffic).

To check another tree (an old commit, a branch)::

    mkdir -p /tmp/old && git archive 6172395 src/nvpair | tar -x -C /tmp/old
    python -m tests.test_layers --root /tmp/old/src
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

#: lowest first; a module may import modules of its own rank or below (prefixes: a package
#: covers its modules). A new module must be placed here: an unplaced one fails the test.
RANKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("nvpair.errors", "nvpair.decoding", "nvpair.ages", "nvpair.urls",
                "nvpair.tls", "nvpair.streams", "nvpair.boundary", "nvpair.logs",
                "nvpair.looplag", "nvpair.changes", "nvpair.histogram", "nvpair.evict",
                "nvpair.memtrend", "nvpair.memproc", "nvpair.collector", "nvpair.answer",
                "nvpair.oneshot",
                "nvpair.wakes")),
    ("config", ("nvpair.manifest", "nvpair.command", "nvpair.cluster", "nvpair.config",
                "nvpair.schema", "nvpair.deploy", "nvpair.group.spec")),
    ("snapshot", ("nvpair.snapshot", "nvpair.state", "nvpair.traffic", "nvpair.listing",
                  "nvpair.events", "nvpair.group.machine",
                  "nvpair.history", "nvpair.memstate")),
    ("supervision", ("nvpair.probes", "nvpair.prober", "nvpair.sweep", "nvpair.process",
                     "nvpair.lifecycle", "nvpair.supervisor", "nvpair.orphans",
                     "nvpair.group.runner", "nvpair.memwatch")),
    ("http", ("nvpair.asgi", "nvpair.views", "nvpair.sse", "nvpair.api", "nvpair.control",
              "nvpair.server", "nvpair.metrics", "nvpair.group.view",
              "nvpair.dashboard")),
    ("router", ("nvpair.router",)),
    ("peers", ("nvpair.peers", "nvpair.group.link", "nvpair.group.epochkey")),
    ("service", ("nvpair.service", "nvpair.openapi")),
    # nvpair.group is only its package's docstring; its modules are placed above, each in
    # its own layer (a lower rank wins, so the package's name goes last)
    ("cli", ("nvpair.cli", "nvpair.__main__", "nvpair.group")),
)
#: a program of its own (``python -m nvpair.sim``): outside the ranks, see the sim rules.
SIM = "nvpair.sim"

SUPERVISION = ("nvpair.probes", "nvpair.prober", "nvpair.sweep", "nvpair.process",
               "nvpair.lifecycle", "nvpair.supervisor", "nvpair.orphans", "nvpair.group.runner",
               "nvpair.memwatch")
PURE_CONFIG = ("nvpair.config", "nvpair.cluster", "nvpair.manifest", "nvpair.decoding",
               "nvpair.errors", "nvpair.command", "nvpair.group.spec")
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


def read_graph(root: Path) -> Graph:
    """The import graph of the ``nvpair`` package under ``root`` (a ``src`` directory)."""
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
            for alias in node.names:  # `from nvpair import views` imports nvpair.views
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
         sources=("nvpair.api", "nvpair.views", "nvpair.asgi"), forbidden=SUPERVISION),
    Rule("config, manifest, decoding, errors and command import no trio, httpx2, httpcore2",
         sources=PURE_CONFIG, forbidden=IO_LIBRARIES,
         allowed=(("nvpair.urls", "httpx2"),)),  # httpx2.URL: the clients' URL parser, no I/O
    Rule("supervision imports no asgi, views, api, router or control",
         sources=SUPERVISION,
         forbidden=("nvpair.asgi", "nvpair.views", "nvpair.api", "nvpair.router",
                    "nvpair.control", "nvpair.peers", "nvpair.service")),
    Rule("peers import no api, control or views", sources=("nvpair.peers",),
         forbidden=("nvpair.api", "nvpair.control", "nvpair.views", "nvpair.service")),
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


def by_name_violations(graph: Graph) -> list[str]:
    """Imports of nvpair modules by a string hide the arrow from static checks (and this
    test reads them anyway): write them as import statements."""
    return sorted({str(a) for arrows in graph.arrows.values() for a in arrows
                   if a.by_name and under(a.target, ("nvpair",))})


def all_violations(root: Path) -> dict[str, list[str]]:
    graph = read_graph(root)
    out = {r.name: r.violations(graph) for r in RULES}
    out["sim imports nothing of nvpair outside nvpair.sim"] = sim_violations(graph)
    out["imports point down the ranks"] = rank_violations(graph)
    out["no nvpair module is imported by name"] = by_name_violations(graph)
    return out


@pytest.fixture(scope="module")
def graph() -> Graph:
    return read_graph(SRC)


def test_the_graph_is_the_package(graph: Graph) -> None:
    assert {"nvpair.api", "nvpair.config", "nvpair.peers.table", "nvpair.sim.cli"} <= graph.modules
    assert len(graph.modules) > 60
    assert any(a.target == "trio" for a in graph.out("nvpair.snapshot"))


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
    found = all_violations(tmp_path / "src")
    text = "\n".join(f"{rule}: {v}" for rule, vs in found.items() for v in vs)
    for rule, arrow in [
        ("imports point down the ranks", "nvpair.config:32 imports nvpair.peers.settings"),
        ("supervision imports no asgi", "nvpair.prober:21 imports nvpair.router.traffic"),
        ("supervision imports no asgi", "nvpair.supervisor:12 imports nvpair.router.traffic"),
        ("supervision imports no asgi", "nvpair.lifecycle:26 imports nvpair.asgi"),
        ("supervision imports no asgi", "nvpair.lifecycle:36 imports nvpair.views"),
        ("supervision imports no asgi", "nvpair.lifecycle:32 imports nvpair.router.traffic"),
        ("peers import no api", "nvpair.peers.broker:12 imports nvpair.api"),
        ("peers import no api", "nvpair.peers.advert:17 imports nvpair.views"),
        ("peers import no api", "nvpair.peers.table:27 imports nvpair.views"),
        ("peers import no api", "nvpair.peers.etcd:38 imports nvpair.views"),
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
    args = parser.parse_args(argv)
    failed = 0
    for rule, found in all_violations(args.root).items():
        print(f"{'FAIL' if found else 'ok  '} {rule}")
        for line in found:
            print(f"       {line}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
