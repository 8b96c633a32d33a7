"""`nvpair demo` as the README runs it: engines come up, Ctrl-C leaves nothing behind."""

import contextlib
import signal
import socket
import subprocess
import sys

import httpx2
import trio
from tests.managed import free_port, group_members


async def test_demo_lists_models_and_stops_cleanly() -> None:
    port = free_port()
    with trio.fail_after(60):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "demo", "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                ids: set[str] = set()
                while len(ids) < 5:  # 4 engines, Ollama with two models
                    with contextlib.suppress(httpx2.ConnectError):
                        ids = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
                    await trio.sleep(0.1)  # an external process: nothing to wait on but it
                engines = (await client.get("/v1/engines")).json()["engines"]
                page = await client.get("/ui/")  # the dashboard whose URL the demo prints
                assert page.status_code == 200
                assert page.headers["content-type"].startswith("text/html")
            pids = [e["pid"] for e in engines]
            assert all(group_members(pid) for pid in pids)
            proc.send_signal(signal.SIGINT)
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    assert code == 0
    assert "llama3.2:latest" in ids and "qwen3:0.6b" in ids
    assert all(group_members(pid) == [] for pid in pids)
    assert proc.stdout is not None
    out = b""
    while chunk := await proc.stdout.receive_some(65536):
        out += chunk
    assert b"/v1/models" in out and b"no engine left running" in out
    assert f"dashboard: http://127.0.0.1:{port}/ui/".encode() in out


def test_demo_on_a_busy_port_is_one_line_and_exit_1() -> None:
    """The bind error reaches the demo wrapped in the nurseries' exception groups."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "nvpair", "demo", "--listen",
                            f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"nvpair: error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in r.stderr
