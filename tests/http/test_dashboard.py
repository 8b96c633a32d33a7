"""The dashboard's serving module without a browser: files, ETags, the CSP, redirects,
names that are not its files, and GET /v1/history, through the API as nvpair mounts it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvpair import __version__
from nvpair.http.api import Api
from nvpair.http.asgi import Mount
from nvpair.http.dashboard import (
    CSP,
    UI_DIR,
    Dashboard,
    HistoryView,
    etag_matches,
    history_query,
    load,
)
from nvpair.state.history import History
from nvpair.state.snapshot import Board, EngineState

ORIGIN = "http://127.0.0.1:14322"


def app(token: str | None = None, board: Board | None = None) -> Api:
    board = board or Board((EngineState(name="e", kind="vllm", url="http://127.0.0.1:1",
                                        managed=False),))
    history = History(board)
    history.observe(board.current, 0.0)  # as History.run does first
    mounts = [Mount(handler=Dashboard(token_set=token is not None), paths=Dashboard.paths,
                    prefix=Dashboard.prefix, own_auth=True),
              Mount(handler=HistoryView(history, "n1"), paths=frozenset({"/v1/history"}))]
    return Api(board, node="n1", token=token, mounts=mounts)


def client(api: Api, base: str = ORIGIN) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=api), base_url=base)


async def test_the_page_and_its_files_with_their_types_and_headers() -> None:
    async with client(app()) as c:
        page = await c.get("/ui/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-cache"
        assert page.content == (UI_DIR / "index.html").read_bytes()
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"),
                           ("favicon.svg", "image/svg+xml")):
            r = await c.get(f"/ui/{name}")
            assert r.status_code == 200, name
            assert r.headers["content-type"].split(";")[0] == kind
            assert r.headers["content-security-policy"] == CSP.decode()
        head = await c.head("/ui/app.js")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len((UI_DIR / "app.js").read_bytes()))


async def test_etag_gives_304_and_a_changed_file_a_new_tag() -> None:
    async with client(app()) as c:
        first = await c.get("/ui/app.js")
        tag = first.headers["etag"]
        again = await c.get("/ui/app.js", headers={"if-none-match": tag})
        assert again.status_code == 304 and again.content == b""
        assert again.headers["etag"] == tag
        weak = await c.get("/ui/app.js", headers={"if-none-match": f'"x", W/{tag}'})
        assert weak.status_code == 304
        other = await c.get("/ui/app.js", headers={"if-none-match": '"not-it"'})
        assert other.status_code == 200 and other.content == first.content
        css = await c.get("/ui/style.css")
        assert css.headers["etag"] != tag


def test_an_etag_follows_the_content(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("one")
    before = load(tmp_path)["index.html"].etag
    (tmp_path / "index.html").write_text("two")
    assert load(tmp_path)["index.html"].etag != before


@given(st.text(max_size=200))
def test_if_none_match_parser_takes_any_header(value: str) -> None:
    raw = value.encode("utf-8", "replace")
    assert etag_matches(raw, b'"abc"') == (
        b"*" in [t.strip() for t in raw.split(b",")]
        or b'"abc"' in [t.strip().removeprefix(b"W/") for t in raw.split(b",")])


async def test_root_and_ui_redirect_relatively() -> None:
    async with client(app()) as c:
        for path in ("/", "/ui"):
            r = await c.get(path)
            assert r.status_code == 302, path
            assert r.headers["location"] == "ui/"  # relative: a proxy's prefix is kept
        # what a browser does with it, under a prefix
        assert str(httpx2.URL("https://proxy/nvpair/").join("ui/")) == "https://proxy/nvpair/ui/"
        assert str(httpx2.URL("https://proxy/nvpair/ui").join("ui/")) == "https://proxy/nvpair/ui/"


@pytest.mark.parametrize("path", ["/ui/../api.py", "/ui/..%2Fapi.py", "/ui/%2e%2e/api.py",
                                  "/ui/ui/index.html", "/ui/app.js/", "/ui/__init__.py",
                                  "/ui/.hidden", "/ui//etc/passwd", "/ui/app.js%00"])
async def test_names_that_are_not_its_files_are_404(path: str) -> None:
    async with client(app()) as c:
        r = await c.get(path)
        assert r.status_code == 404, (path, r.status_code)
        assert "import" not in r.text  # no source of nvpair's


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
async def test_any_name_is_a_file_of_the_page_or_404(name: str) -> None:
    files = load()
    dashboard = Dashboard(token_set=True, files=files)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request"}

    await dashboard({"type": "http", "method": "GET", "path": "/ui/" + name, "headers": []},
                    receive, send)
    status = sent[0]["status"]
    assert status == (200 if (name or "index.html") in files else 404)
    if status == 200:
        assert sent[1]["body"] == files[name or "index.html"].body


async def test_only_get_and_head() -> None:
    async with client(app()) as c:
        r = await c.post("/ui/")
        assert r.status_code == 405


async def test_without_a_token_a_foreign_host_is_refused_a_link_from_another_site_is_not(
) -> None:
    async with client(app()) as c:
        rebound = await c.get("/ui/", headers={"host": "evil.example:14322"})
        assert rebound.status_code == 403
        assert rebound.json()["error"]["code"] == "forbidden_host"
        linked = await c.get("/ui/", headers={"sec-fetch-site": "cross-site"})
        assert linked.status_code == 200
        # ... while the API behind the page keeps refusing cross-site requests
        post = await c.post("/v1/engines/e/stop", headers={"origin": "https://evil.example"})
        assert post.status_code == 403
        read = await c.get("/v1/history", headers={"sec-fetch-site": "cross-site"})
        assert read.status_code == 403
        # and the page's own requests (same origin) pass
        own = await c.get("/v1/history", headers={"sec-fetch-site": "same-origin",
                                                  "origin": ORIGIN})
        assert own.status_code == 200


async def test_with_a_token_the_page_loads_without_it_and_its_data_needs_it() -> None:
    async with client(app(token="t0k"), base="http://mybox.example:14322") as c:
        assert (await c.get("/ui/")).status_code == 200
        assert (await c.get("/v1/history")).status_code == 401
        r = await c.get("/v1/history", headers={"authorization": "Bearer t0k"})
        assert r.status_code == 200


async def test_history_view_says_version_uptime_and_series() -> None:
    async with client(app()) as c:
        doc = (await c.get("/v1/history")).json()
        assert doc["node"] == "n1" and doc["version"] == __version__
        assert doc["uptime_s"] >= 0
        assert doc["step_s"] == 10 and set(doc["engines"]) == {"e"}
        assert doc["engines"]["e"] == {"first_age_s": 0.0, "latency_ms": [],
                                       "latency_ms_max": [], "memory_bytes": []}
        assert (await c.post("/v1/history")).status_code == 405
        assert doc["routes"] == {"groups": False, "peers": False}
        for query in ("points=0", "points=61", "engine=e&points=361", "points=x",
                      "points=1&points=2",
                      "engine=a&engine=b"):
            r = await c.get(f"/v1/history?{query}")
            assert r.status_code == 400, query
            assert r.json()["error"]["message"].split(":")[0] in ("points", "engine")
        assert (await c.get("/v1/history?points=60&engine=nope")).json()["engines"] == {}


@given(st.binary(max_size=80))
def test_history_query_is_parameters_or_one_line_naming_one(raw: bytes) -> None:
    try:
        engine, points = history_query(raw)
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc).split(":")[0] in ("points", "engine")
    else:
        assert points is None or 1 <= points <= (360 if engine is not None else 60)
        assert engine is None or isinstance(engine, str)


async def test_history_says_which_optional_routes_exist_with_mounts_added_after_it() -> None:
    board = Board(())
    mounts: list[Mount] = []
    view = HistoryView(History(board), "n1", mounts)
    mounts.append(Mount(handler=view, paths=frozenset({"/v1/history"})))
    mounts.append(Mount(handler=view, paths=frozenset({"/v1/groups"}), prefix="/v1/groups/"))
    async with client(Api(board, node="n1", mounts=mounts)) as c:
        assert (await c.get("/v1/history")).json()["routes"] == {"groups": True,
                                                                 "peers": False}


def test_the_files_are_small_and_use_no_other_origin_nor_html_insertion() -> None:
    files = load()
    assert {"index.html", "app.js", "style.css"} <= set(files)
    assert sum(len(f.body) for f in files.values()) < 60_000
    for name, f in files.items():
        text = f.body.decode()
        urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", text)
        assert all("//" not in u and not u.startswith("/") for u in urls), (name, urls)
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", ""), name
        assert "https://" not in text, name
    js = files["app.js"].body.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js, sink
    assert "localStorage" not in js  # the token lives in the tab's sessionStorage only


def test_the_files_are_in_the_wheel(tmp_path: Path) -> None:
    """A wheel built from the tree holds the page (package data, not just the checkout)."""
    import importlib.util
    import subprocess
    import sys
    import zipfile

    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("hatchling (the build backend) is not installed: no wheel to look into")
    root = Path(__file__).resolve().parents[2]
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path), str(root)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-500:]
    wheel = next(tmp_path.glob("nvpair-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("index.html", "app.js", "style.css", "favicon.svg"):
        assert f"nvpair/http/ui/{name}" in names, name
