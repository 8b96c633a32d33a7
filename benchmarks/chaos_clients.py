"""Misbehaving clients for the chaos suite, on plain blocking sockets.

Each function does one kind of misbehaviour against nvpair's API at ``host:port`` and
returns what it saw (a dict for the report) and whether that is what nvpair promises
(``ok``) with a one-line ``why`` when it is not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import resource
import secrets
import socket
import threading
import time
from typing import Any


def raise_nofile(want: int) -> int:
    """Raise this process's own RLIMIT_NOFILE soft limit (toward ``want``); the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = min(max(soft, want), hard) if hard != resource.RLIM_INFINITY else max(soft, want)
    if new != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


def raw(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a new connection; everything read until EOF or ``timeout``."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out and _complete(out):
                    break
        return out


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return len(body) >= int(v.strip() or 0)
    return False


def status_of(answer: bytes) -> int:
    """The status of a raw HTTP answer; 0 when there was none (the connection was closed)."""
    parts = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def get(host: str, port: int, path: str, headers: dict[str, str] | None = None,
        method: str = "GET", body: bytes | None = None, timeout: float = 5.0
        ) -> tuple[int, bytes]:
    """One request on a new connection that the server closes (``Connection: close``)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Connection": "close", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# -- the cases -------------------------------------------------------------------------------


def slow_poller(host: str, port: int, every_s: float, polls: int) -> dict[str, Any]:
    """One keep-alive connection, a GET every ``every_s`` seconds, no retry (Python's
    ``http.client``, as the desktop's loop in the report)."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    errors: list[str] = []
    try:
        for i in range(polls):
            if i:
                time.sleep(every_s)
            try:
                conn.request("GET", "/v1/models")
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    errors.append(f"poll {i + 1}: status {r.status}")
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"poll {i + 1}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=5)
    finally:
        conn.close()
    return {"polls": polls, "tried": polls, "every_s": every_s, "errors": len(errors),
            "ok": not errors, "why": errors[0] if errors else ""}


def half_closed(host: str, port: int, n: int) -> dict[str, Any]:
    """``n`` clients that send a request and shut their side (SHUT_WR) before the answer,
    ``n`` that connect and close having sent nothing, then ``n`` that read the answer and
    close (the ones a server notices only if it watches idle connections)."""
    answered = 0
    for _ in range(n):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            s.shutdown(socket.SHUT_WR)
            data = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    data += chunk
                    if _complete(data):
                        break
            answered += status_of(data) == 200
    for _ in range(n):
        with socket.create_connection((host, port), timeout=5):
            pass
    closed_after = 0
    for _ in range(n):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            data = b""
            with contextlib.suppress(OSError):
                while not _complete(data) and (chunk := s.recv(65536)):
                    data += chunk
            closed_after += status_of(data) == 200
    ok = answered == n and closed_after == n
    return {"clients": 3 * n, "tried": 3 * n, "half_closed_answered": answered,
            "answered_then_closed": closed_after, "ok": ok,
            "why": "" if ok else f"half-closed answered {answered}/{n}, "
                                 f"others {closed_after}/{n}"}


def slow_requests(host: str, port: int, n: int, within_s: float) -> dict[str, Any]:
    """``n`` connections that send a request's headers one byte a second (never ending),
    and ``n`` whose POST body comes one byte a second: how many nvpair closed within
    ``within_s`` (a deadline for headers and for bodies)."""
    socks: list[tuple[str, socket.socket, bytes]] = []
    head = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: ".encode()
    post = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()
    for i in range(2 * n):
        s = socket.create_connection((host, port), timeout=5)
        s.setblocking(False)
        kind = "headers" if i < n else "body"
        s.sendall(head if kind == "headers" else post)
        socks.append((kind, s, b""))
    closed = {"headers": 0, "body": 0}
    closed_at: list[float] = []
    open_ = list(socks)
    started = time.monotonic()
    try:
        while open_ and time.monotonic() - started < within_s:
            time.sleep(1.0)
            still = []
            for kind, s, _ in open_:
                gone = False
                try:
                    s.send(b"a")
                    with contextlib.suppress(BlockingIOError):
                        data = s.recv(65536)
                        gone = not data or status_of(data) >= 400
                except OSError:
                    gone = True
                if gone:
                    closed[kind] += 1
                    closed_at.append(time.monotonic() - started)
                    s.close()
                else:
                    still.append((kind, s, b""))
            open_ = still
    finally:
        for _, s, _ in open_:
            s.close()
    ok = not open_
    return {"slow_headers": n, "slow_bodies": n, "tried": 2 * n,
            "closed_headers": closed["headers"], "closed_bodies": closed["body"],
            "closed_after_s": round(max(closed_at), 1) if closed_at else None, "ok": ok,
            "why": "" if ok else (f"after {within_s:g} s nvpair still held "
                                  f"{n - closed['headers']} slow-header and "
                                  f"{n - closed['body']} slow-body connections")}


def idle_connections(host: str, port: int, n: int) -> tuple[list[socket.socket], dict[str, Any]]:
    """Open ``n`` idle connections (a third after one request, the rest before any); the
    sockets (the caller closes them) and how many connected."""
    socks: list[socket.socket] = []
    failed = 0
    deadline = time.monotonic() + 45
    for i in range(n):
        try:
            s = socket.create_connection((host, port), timeout=3.0)
        except OSError:
            failed += 1
            if failed > 20 or time.monotonic() > deadline:
                break
            continue
        if i % 3 == 0:
            with contextlib.suppress(OSError):
                s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        socks.append(s)
    return socks, {"opened": len(socks), "connect_failures": failed}



def timed_healthz(host: str, port: int, timeout: float = 5.0) -> tuple[int, float]:
    """A new client's ``/healthz``: (status, seconds); status 0 when it got no answer."""
    t0 = time.monotonic()
    try:
        status, _ = get(host, port, "/healthz", timeout=timeout)
    except (OSError, http.client.HTTPException):
        status = 0
    return status, time.monotonic() - t0


def oversized_headers(host: str, port: int) -> dict[str, Any]:
    """One header of 100 KiB; 200 headers of 1 KiB; a 64 KiB request line."""
    base = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n"
    tries = {
        "one 100 KiB header": (base + "X-Big: " + "b" * 100_000 + "\r\n\r\n").encode(),
        "200 headers of 1 KiB": (base + "".join(f"X-H{i}: {'h' * 1000}\r\n"
                                                for i in range(200)) + "\r\n").encode(),
        "64 KiB request line": (f"GET /healthz?{'q' * 65536} HTTP/1.1\r\n"
                                f"Host: {host}:{port}\r\n\r\n").encode(),
    }
    seen = {}
    for name, data in tries.items():
        try:
            seen[name] = status_of(raw(host, port, data))
        except OSError as exc:
            seen[name] = f"{type(exc).__name__}"  # type: ignore[assignment]
    # refused (4xx) or closed (0, reset) is fine; a 200 or a 5xx is not
    bad = {k: v for k, v in seen.items() if isinstance(v, int) and (v == 200 or v >= 500)}
    return {"answers": seen, "tried": len(tries), "ok": not bad,
            "why": "" if not bad else "; ".join(f"{k}: {v}" for k, v in bad.items())}


def browser(host: str, port: int, engine: str) -> dict[str, Any]:
    """What a web page the operator opens can send: a cross-site simple POST that stops an
    engine, a DNS-rebound Host, a router POST that is not JSON; and the same from
    loopback origins (allowed)."""
    own = f"{host}:{port}"
    seen: dict[str, int] = {}
    seen["cross-site POST stop (Origin evil)"] = get(
        host, port, f"/v1/engines/{engine}/stop", method="POST", body=b"",
        headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})[0]
    seen["rebound Host evil.example"] = get(
        host, port, "/v1/models", headers={"Host": f"evil.example:{port}"})[0]
    seen["router POST text/plain"] = get(
        host, port, "/v1/chat/completions", method="POST",
        body=json.dumps({"model": "x", "messages": []}).encode(),
        headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})[0]
    seen["GET with Origin loopback"] = get(
        host, port, "/v1/models", headers={"Origin": f"http://{own}"})[0]
    seen["GET with Host localhost"] = get(
        host, port, "/v1/models", headers={"Host": f"localhost:{port}"})[0]
    refused = [k for k in list(seen)[:3] if seen[k] != 403]
    allowed = [k for k in list(seen)[3:] if seen[k] != 200]
    ok = not refused and not allowed
    why = "; ".join([f"{k}: {seen[k]} (403 expected)" for k in refused]
                    + [f"{k}: {seen[k]} (200 expected)" for k in allowed])
    return {"answers": seen, "tried": len(seen), "ok": ok, "why": why}


def chat_body(model: str, *, stream: bool = False, max_tokens: int | None = None) -> bytes:
    doc: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        doc["stream"] = True
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    return json.dumps(doc).encode()


def burst(host: str, port: int, model: str, n: int, timeout: float) -> list[tuple[float, int]]:
    """``n`` non-streaming chats for ``model`` at once, each on its own connection:
    (seconds from the start to its answer, status; 0 for no answer), in finishing order."""
    out: list[tuple[float, int]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def one() -> None:
        try:
            status, _ = get(host, port, "/v1/chat/completions", method="POST",
                            body=chat_body(model), timeout=timeout,
                            headers={"Content-Type": "application/json"})
        except (OSError, http.client.HTTPException):
            status = 0
        with lock:
            out.append((round(time.monotonic() - t0, 2), status))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return sorted(out)


class Stream(threading.Thread):
    """One streamed chat, read line by line in a thread: its status, its ``data:`` events
    (with when each came) and how it ended."""

    def __init__(self, host: str, port: int, model: str, max_tokens: int,
                 timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.model = host, port, model
        self.max_tokens, self.timeout = max_tokens, timeout
        self.status = 0
        self.events: list[tuple[float, str]] = []
        self.failure = ""  # the exception that ended the reading, if one did
        self.ended_at: float | None = None
        self.chunk = threading.Event()  # set at the first content chunk

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/chat/completions",
                         body=chat_body(self.model, stream=True, max_tokens=self.max_tokens),
                         headers={"Content-Type": "application/json", "Connection": "close"})
            r = conn.getresponse()
            self.status = r.status
            while line := r.readline():
                text = line.decode(errors="replace").strip()
                if text.startswith("data:"):
                    self.events.append((time.monotonic(), text[5:].strip()))
                    if '"content"' in text:
                        self.chunk.set()
        except (OSError, http.client.HTTPException) as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            conn.close()
            self.chunk.set()

    @property
    def done(self) -> bool:
        """Ended with ``data: [DONE]`` (the whole answer)."""
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    @property
    def error(self) -> str:
        """The message of an error event in the stream ('' when none)."""
        for _, data in self.events:
            if data.startswith("{") and '"error"' in data:
                with contextlib.suppress(ValueError):
                    err = json.loads(data).get("error")
                    return str(err.get("message") if isinstance(err, dict) else err)
        return ""

    @property
    def contents(self) -> int:
        return sum('"content"' in data for _, data in self.events)


def silent_events(host: str, port: int) -> socket.socket:
    """``GET /v1/events`` from a client that never reads: a receive buffer of 4 KiB
    (set before connecting, so the window stays small), then nothing."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect((host, port))
    s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return s


class Flapper(threading.Thread):
    """A peer whose adverts flap: every ``every_s`` an advert alternately with ``models``
    models and with none, a new boot (as a restart) every tenth; a leaving advert at the
    end. Each model id is long, so that each advert is tens of KiB."""

    def __init__(self, host: str, port: int, token: str, node: str, url: str,
                 every_s: float = 0.1, models: int = 120) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.node, self.url = host, port, node, url
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.every_s = every_s
        self.ids = [f"{node}-model-{i:03d}-" + "x" * 150 for i in range(models)]
        self.stop = threading.Event()
        self.sent = 0
        self.answers: dict[int, int] = {}

    def advert(self, boot: str, seq: int, leaving: bool = False) -> bytes:
        ids = self.ids if seq % 2 else []
        return json.dumps({
            "node": self.node, "boot_id": boot, "seq": seq, "ttl_s": 10, "url": self.url,
            "leaving": leaving,
            "engines": [{"name": "e", "kind": "openai", "state": "ready", "models": ids}],
            "models": [{"id": m, "engine": "e", "kind": "openai"} for m in ids],
        }).encode()

    def post(self, body: bytes) -> None:
        try:
            status = get(self.host, self.port, "/v1/peers/adverts", method="POST", body=body,
                         headers=self.headers)[0]
        except (OSError, http.client.HTTPException):
            status = 0
        self.answers[status] = self.answers.get(status, 0) + 1
        self.sent += 1

    def run(self) -> None:
        boot, seq = secrets.token_hex(8), 1
        while not self.stop.is_set():
            started = time.monotonic()
            self.post(self.advert(boot, seq))
            seq += 1
            if seq % 10 == 0:
                boot, seq = secrets.token_hex(8), 1
            self.stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
        self.post(self.advert(boot, seq, leaving=True))


class Polite:
    """The suite's own requests: one keep-alive connection per server, reused (a new one
    when the server closed it), so the suite itself leaves no socket in CLOSE-WAIT."""

    def __init__(self) -> None:
        self.conns: dict[tuple[str, int], http.client.HTTPConnection] = {}

    def request(self, method: str, url: str, body: object = None, timeout: float = 5.0
                ) -> tuple[int, bytes]:
        hostport, _, path = url.removeprefix("http://").partition("/")
        host, _, port = hostport.rpartition(":")
        key = (host, int(port))
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (1, 2):
            conn = self.conns.get(key)
            fresh = conn is None
            if conn is None:
                conn = self.conns[key] = http.client.HTTPConnection(host, key[1])
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, "/" + path, body=data, headers=headers)
                r = conn.getresponse()
                out = r.status, r.read()
                if r.will_close:
                    self.drop(key)
                return out
            except (OSError, http.client.HTTPException):
                self.drop(key)
                if fresh or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def drop(self, key: tuple[str, int]) -> None:
        conn = self.conns.pop(key, None)
        if conn is not None:
            conn.close()

    def get_json(self, url: str, timeout: float = 5.0) -> Any:
        status, body = self.request("GET", url, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
        return json.loads(body)

    def close(self) -> None:
        for key in list(self.conns):
            self.drop(key)

