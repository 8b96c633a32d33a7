"""The docs against the tree: docs/architecture.md names only what exists, and names every
module under the layer it is in; README.md and docs/ link nothing outside the repository.

Names are read without importing anything: ``nvpair.x.y`` is the longest module of
``src/nvpair`` it starts with, then a name defined at the top of that module (a class, a
function, an assignment, an import), then, for a class, a name defined in its body.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from tests.test_layers import RANKS, SIM, rank, read_graph, under

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: file names that look like module names
NOT_MODULES = frozenset({"nvpair.toml"})

_CODE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./])nvpair(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w.])(?:src/)?nvpair/[\w/]+\.py\b")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "nvpair").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), str(path))


def _defined(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, fallbacks
            names |= _defined(node.body)
    return names


def _class(body: list[ast.stmt], name: str) -> ast.ClassDef | None:
    return next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)


def problem(name: str, tree: dict[str, Path]) -> str | None:
    """Why the dotted ``name`` does not exist in the tree (None when it does)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in tree:
            break
    else:
        return f"{name}: no such module"
    rest = parts[cut:]
    if not rest:
        return None
    body = _tree(tree[module]).body
    if rest[0] not in _defined(body):
        if tree[module].name == "__init__.py":
            return f"{name}: no module {module}.{rest[0]}, and {module} defines no {rest[0]}"
        return f"{name}: {module} defines no {rest[0]}"
    cls = _class(body, rest[0])
    if len(rest) > 1 and cls is not None and rest[1] not in _defined(cls.body):
        return f"{name}: {module}.{rest[0]} defines no {rest[1]}"
    return None


def names_in(text: str) -> set[str]:
    """``nvpair.x`` names and ``nvpair/x.py`` paths in the code spans of ``text``, as
    dotted names."""
    found: set[str] = set()
    for span in _CODE.findall(text):
        found.update(m for m in _DOTTED.findall(span) if m not in NOT_MODULES)
        for path in _PATH.findall(span):
            dotted = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
            found.add(dotted.removesuffix(".__init__"))
    return found


def test_every_name_in_architecture_md_exists() -> None:
    tree = modules()
    names = names_in(ARCHITECTURE.read_text())
    assert len(names) > 80
    assert [p for n in sorted(names) if (p := problem(n, tree))] == []


def test_the_check_finds_what_does_not_exist() -> None:
    tree = modules()
    assert problem("nvpair.snapshot.Board.update", tree) is None
    assert problem("nvpair.router.ROUTED_PATHS", tree) is None  # re-exported
    assert problem("nvpair.supervisor", tree) == (
        "nvpair.supervisor: no module nvpair.supervisor, and nvpair defines no supervisor")
    assert problem("nvpair.prober.registry", tree) == (
        "nvpair.prober.registry: nvpair.prober defines no registry")
    assert problem("nvpair.sweep.Sweep._paths", tree) == (
        "nvpair.sweep.Sweep._paths: nvpair.sweep.Sweep defines no _paths")
    assert names_in("`src/nvpair/peers/table.py` and `nvpair.toml`, `nvpair.api.Api`") == {
        "nvpair.peers.table", "nvpair.api.Api"}


def _sections(text: str) -> dict[str, set[str]]:
    """Under each ``### <layer>`` heading of "The modules", the modules its bullets name."""
    body = text.split("## The modules", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    current = None
    for line in body.splitlines():
        if line.startswith("### "):
            current = line.removeprefix("### ").split(" (")[0].strip()
            out[current] = set()
        elif current is not None and line.startswith("* "):
            lead = line.split(": ", 1)[0]
            out[current].update(m for m in _DOTTED.findall(lead) if m in modules())
    return out


def test_architecture_md_lists_every_module_under_its_layer() -> None:
    sections = _sections(ARCHITECTURE.read_text())
    layers = [name for name, _ in RANKS]
    assert [s for s in sections if s != "sim"] == layers, "the layers, in RANKS' order"
    graph = read_graph(SRC)
    listed = set().union(*sections.values())
    assert sorted(graph.modules - listed - {"nvpair"}) == [], "modules missing from the page"
    wrong = []
    for section, names in sections.items():
        for name in names:
            want = "sim" if under(name, (SIM,)) else RANKS[rank(name)][0]  # type: ignore[index]
            if want != section:
                wrong.append(f"{name} is listed under {section}, its layer is {want}")
    assert wrong == []


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    return [a or b for a, b in _LINK.findall(text)]


def outside(doc: Path, target: str) -> str | None:
    """Why a link from ``doc`` to ``target`` leaves the repository (None if it does not)."""
    if "shared/reference" in target:
        return f"{target}: the project's reference material is not in the repository"
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None  # a web address, mailto:, or an anchor on the same page
    path = target.split("#", 1)[0]
    resolved = (doc.parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not resolved.exists():
        return f"{target}: no such file in the repository"
    return None


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_link_nothing_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "shared/reference" not in text
    assert [p for t in links(text) if (p := outside(doc, t))] == []


def test_the_link_check_finds_links_outside() -> None:
    doc = ROOT / "docs" / "api.md"
    assert links("[a](../README.md) [b](https://x.org/a) and\n[c]: ../../x/y.md\n") == [
        "../README.md", "https://x.org/a", "../../x/y.md"]
    assert outside(doc, "../README.md") is None
    assert outside(doc, "states.md#probes") is None
    assert outside(doc, "https://example.org/") is None
    assert outside(doc, "../../shared/reference/structure-review.md") is not None
    assert outside(doc, "../../elsewhere.md") == "../../elsewhere.md: outside the repository"
    assert outside(doc, "nosuch.md") == "nosuch.md: no such file in the repository"


def startables() -> list[tuple[str, ast.AsyncFunctionDef]]:
    """Every coroutine of the package that takes ``task_status`` (for ``nursery.start``)."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.AsyncFunctionDef) and any(
                    a.arg == "task_status" for a in (*node.args.args, *node.args.kwonlyargs)):
                found.append((f"{name}:{node.lineno} {node.name}", node))
    return found


def test_every_startable_says_its_started_value_cancellation_and_raises() -> None:
    """What ``nursery.start`` hands back, how it ends when cancelled and what it raises."""
    found = startables()
    assert len(found) > 15
    missing = []
    for where, node in found:
        doc = (ast.get_docstring(node) or "").lower()
        lacks = [what for what, words in (("started value", ("started value",)),
                                           ("cancellation", ("cancellation", "cancelling")),
                                           ("raises", ("raises",)))
                 if not any(w in doc for w in words)]
        if lacks:
            missing.append(f"{where}: no {', '.join(lacks)} in its docstring")
    assert missing == []
