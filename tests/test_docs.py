"""The docs against the tree: docs/architecture.md names only what exists and lists the
folders in their layers' order, each folder's docstring names each of its modules; README.md
and docs/ link nothing outside the repository.

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
    assert len(names) > 40
    assert [p for n in sorted(names) if (p := problem(n, tree))] == []


def test_the_check_finds_what_does_not_exist() -> None:
    tree = modules()
    assert problem("nvpair.state.snapshot.Board.update", tree) is None
    assert problem("nvpair.router.ROUTED_PATHS", tree) is None  # re-exported
    assert problem("nvpair.supervisor", tree) == (
        "nvpair.supervisor: no module nvpair.supervisor, and nvpair defines no supervisor")
    assert problem("nvpair.probing.prober.registry", tree) == (
        "nvpair.probing.prober.registry: nvpair.probing.prober defines no registry")
    assert problem("nvpair.probing.sweep.Sweep._paths", tree) == (
        "nvpair.probing.sweep.Sweep._paths: nvpair.probing.sweep.Sweep defines no _paths")
    assert names_in("`src/nvpair/peers/table.py` and `nvpair.toml`, `nvpair.http.api.Api`") == {
        "nvpair.peers.table", "nvpair.http.api.Api"}


def _folders(text: str) -> list[str]:
    """The folders (and top-level modules) "The folders" of the page lists, in its order."""
    body = text.split("## The folders", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in body.splitlines():
        if line.startswith("* "):
            out += _DOTTED.findall(line.split(": ", 1)[0])
    return out


def test_architecture_md_lists_the_folders_in_their_order() -> None:
    listed = [f for f in _folders(ARCHITECTURE.read_text()) if not under(f, (SIM,))]
    apart = ("nvpair.errors", "nvpair.__main__")  # (named after the list, with the simulators)
    assert listed == [p for _, prefixes in RANKS for p in prefixes if p not in apart], (
        "the layers, in RANKS' order")


def _docstring_modules(package: Path) -> set[str]:
    doc = ast.get_docstring(_tree(package / "__init__.py")) or ""
    return set(re.findall(r"^\* ``(\w+)``", doc, re.MULTILINE))


def test_each_folder_lists_its_modules_in_its_docstring() -> None:
    """A folder's ``__init__.py`` says what each of its modules is, one line each: a module
    added, moved or removed without its line fails here."""
    wrong = []
    for _, prefixes in RANKS:
        for prefix in prefixes:
            package = SRC / Path(*prefix.split("."))
            if not package.is_dir() or prefix == "nvpair.cli":
                continue
            present = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
            present |= {p.name for p in package.iterdir()
                        if p.is_dir() and (p / "__init__.py").exists()}
            named = _docstring_modules(package)
            wrong += [f"{prefix}.{m}: not in its folder's docstring" for m in present - named]
            wrong += [f"{prefix}.{m}: named in the docstring, no such module"
                      for m in named - present]
    assert wrong == []


def test_every_module_is_in_a_ranked_folder() -> None:
    graph = read_graph(SRC)
    assert sorted(m for m in graph.modules - {"nvpair", "nvpair.__main__"}
                  if rank(m) is None and not under(m, (SIM,))) == []


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


README = ROOT / "README.md"


def _readme_section(title: str) -> str:
    return README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_command_table_lists_every_command_of_the_cli() -> None:
    """Each of the CLI's commands has a row of the README's table (and no row names a
    command the CLI does not have)."""
    from nvpair.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = set(sub.choices)  # type: ignore[arg-type]
    listed = set()
    for line in _readme_section("Commands").splitlines():
        if line.startswith("| `nvpair "):
            cell = re.split(r"(?<!\\)\|", line)[1]  # (not at an escaped \| in the cell)
            for words in re.findall(r"`nvpair ([a-z][a-z-]*(?:\\\|[a-z]+)*)", cell):
                listed.update(words.split("\\|"))  # start\|stop\|restart: three
    assert sorted(commands - listed) == [], "commands missing from README.md's table"
    assert sorted(listed - commands) == [], "README.md's table names no such command"


def test_the_readme_documentation_list_names_every_page_of_docs() -> None:
    listed = set(re.findall(r"\(docs/([\w-]+\.md)\)", _readme_section("Documentation")))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert sorted(pages - listed) == [], "pages missing from README.md's Documentation list"


def test_the_readme_status_example_has_the_real_header() -> None:
    from nvpair.cli.client import STATUS_HEADER

    example = _readme_section("A real example")
    header = next(line for line in example.splitlines() if line.startswith("ENGINE "))
    assert tuple(header.split()) == STATUS_HEADER


def test_the_default_log_directory_is_stated_once() -> None:
    """docs/config.md says where engine logs go by default; no other page says otherwise
    (docs/lifecycle.md once gave $XDG_STATE_HOME/nvpair/logs, not <state_dir>/logs)."""
    config = (ROOT / "docs" / "config.md").read_text()
    assert "(default: <state_dir>/logs)" in config
    for doc in docs():
        text = doc.read_text()
        for other in ("$XDG_STATE_HOME/nvpair/logs", "~/.local/state/nvpair/logs"):
            assert other not in text, f"{doc.name} gives {other} as the log directory"


def _alert_rules() -> str:
    text = (ROOT / "docs" / "metrics.md").read_text()
    section = text.split("## Example alerts\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


_SAMPLE = re.compile(r"^(?P<series>[a-zA-Z_:][\w:]*(?:\{.*\})?) (?P<value>\S+)$")


def _series(exposition: str) -> list[dict[str, str]]:
    """Each sample of a /metrics answer as a promtool input series, constant for an hour."""
    out = []
    for line in exposition.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        value = float(m["value"])
        if value == value and abs(value) != float("inf"):
            out.append({"series": m["series"], "values": f"{value!r}+0x60"})
    return out


async def _metrics_of(tmp_path: Path, command: list[str], extra: str, state: str) -> str:
    import httpx2
    import trio
    from tests.managed import free_port, managed_config, wait_state

    from nvpair import service

    settings = managed_config(tmp_path, "e", free_port(), command, extra=extra)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running = await nursery.start(service.run, settings)
            await wait_state(running.board, "e", state)
            async with httpx2.AsyncClient(base_url=running.url) as client:
                text = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    return text


def _promtool_test(tmp_path: Path, exposition: str, expected: list[dict[str, object]]) -> None:
    import json
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    (tmp_path / "rules.yml").write_text(_alert_rules())
    names = re.findall(r"- alert: (\w+)", _alert_rules())
    assert len(names) >= 4
    tests = [{"interval": "1m", "input_series": _series(exposition),
              "alert_rule_test": [
                  {"eval_time": "59m", "alertname": name,
                   "exp_alerts": [{k: v for k, v in e.items() if k != "alertname"}
                                  for e in expected if e["alertname"] == name]}
                  for name in names]}]
    test_file = tmp_path / "alerts.test.yml"  # JSON is YAML
    test_file.write_text(json.dumps({"rule_files": ["rules.yml"],
                                     "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


async def test_the_example_alerts_stay_quiet_on_an_on_demand_node_at_rest(tmp_path) -> None:
    """docs/metrics.md's alerts in a real Prometheus rule engine (promtool) over an hour of
    a real nvpair's metrics with a cold on-demand engine: none fires. (The doc's former
    "not up" query, nvpair_engine_up == 0, would: newuser-3.md finding 8.)"""
    import sys

    from tests.managed import sim_command

    exposition = await _metrics_of(tmp_path, sim_command("vllm"),
                                   "activation = 'on_demand'\n", "cold")
    assert 'nvpair_engine_state{engine="e",kind="vllm",state="cold"} 1' in exposition
    assert 'nvpair_engine_up{engine="e"} 0' in exposition
    _promtool_test(tmp_path, exposition, [])
    assert sys.executable  # (the sim ran from this interpreter)


async def test_the_example_alerts_fire_for_an_engine_that_is_down(tmp_path) -> None:
    """The same rules over an nvpair whose engine exits at once: NvpairEngineDown fires
    (so the quiet test above is not quiet because nothing can fire)."""
    import sys

    exposition = await _metrics_of(tmp_path, [sys.executable, "-c", "raise SystemExit(1)"],
                                   "", "down")
    _promtool_test(tmp_path, exposition, [{
        "alertname": "NvpairEngineDown",
        "exp_labels": {"engine": "e", "kind": "vllm", "state": "down"},
        "exp_annotations": {"summary": "engine e is down (nvpair status says why)"}}])
