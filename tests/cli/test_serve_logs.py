"""``nvpair serve --log-format json`` as a real process: stderr holds JSON lines only."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx2
import trio
from tests.managed import FAST_PROBES, free_port, sim_command


async def test_serve_with_json_logs_writes_one_object_per_line(tmp_path) -> None:
    """The announcement, an engine's state changes and the shutdown, each a JSON object
    with the same fields (the text format's coloured transitions are not printed)."""
    path = tmp_path / "nvpair.toml"
    path.write_text(f"listen = '127.0.0.1:0'\nstate_dir = '{tmp_path / 'state'}'\n"
                    f"log_dir = '{tmp_path / 'logs'}'\n"
                    f"[[engines]]\nname = 'e1'\nkind = 'vllm'\nport = {free_port()}\n"
                    f"model = 'm'\nmanaged = true\n"
                    f"command = {json.dumps(sim_command('vllm'))}\n" + FAST_PROBES)
    lines: list[dict[str, object]] = []
    with trio.fail_after(40):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "serve", "-c", str(path), "--log-format", "json"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        try:
            assert proc.stderr is not None
            buffer = b""
            async for chunk in proc.stderr:
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [json.loads(line) for line in done]  # each one parses
                if any(line["event"] == "state" and line["message"].startswith("starting -> ready")
                       for line in lines):
                    break
            proc.send_signal(signal.SIGINT)
            rest = b""
            async for chunk in proc.stderr:
                rest += chunk
            lines += [json.loads(line) for line in (buffer + rest).splitlines()]
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await proc.wait()
    fields = ["time", "level", "logger", "engine", "request_id", "key", "event", "message"]
    assert all(list(line)[:8] == fields for line in lines), lines
    listening = [line for line in lines if line["event"] == "listening"]
    assert len(listening) == 1 and "listening on http://127.0.0.1:" in str(
        listening[0]["message"])
    states = [line for line in lines if line["event"] == "state"]
    assert states[0]["engine"] == "e1"


async def test_a_reload_to_json_makes_every_next_line_json(tmp_path) -> None:
    """``nvpair serve`` in text, then SIGHUP with ``log_format = 'json'``: the reload's own
    line and every line after it (the engine's state changes as it stops too, printed as
    text before) is a JSON object."""
    path = tmp_path / "nvpair.toml"
    engine = (f"[[engines]]\nname = 'e1'\nkind = 'vllm'\nport = {free_port()}\n"
              f"model = 'm'\nmanaged = true\n"
              f"command = {json.dumps(sim_command('vllm'))}\n" + FAST_PROBES)
    top = (f"listen = '127.0.0.1:0'\nstate_dir = '{tmp_path / 'state'}'\n"
           f"log_dir = '{tmp_path / 'logs'}'\n")
    path.write_text(top + engine)
    with trio.fail_after(40):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nvpair", "serve", "-c", str(path)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        try:
            assert proc.stderr is not None
            out = b""
            async for chunk in proc.stderr:
                out += chunk
                if b"starting -> ready" in out:
                    break
            path.write_text(top + "log_format = 'json'\n" + engine)
            proc.send_signal(signal.SIGHUP)
            async for chunk in proc.stderr:
                out += chunk
                if b'"event":"reload"' in out or b"refused" in out:
                    break
            url = re.search(rb"listening on (http://\S+)", out)
            assert url is not None, out
            async with httpx2.AsyncClient(base_url=url[1].decode(), timeout=10) as client:
                asked = await client.post("/v1/engines/e1/stop")  # a state change to say
            assert asked.status_code == 202, asked.text
            async for chunk in proc.stderr:
                out += chunk
                if b"-> stopped" in out:
                    break
            proc.send_signal(signal.SIGINT)
            async for chunk in proc.stderr:
                out += chunk
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await proc.wait()
    text = out.decode()
    before, _, after = text.partition('{"time"')
    assert "e1" in before and "starting -> ready" in before  # text: printed for people
    lines = [json.loads(line) for line in ('{"time"' + after).splitlines()]  # all parse
    assert lines[0]["event"] == "reload" and "log applied" in lines[0]["message"], lines
    assert any(line["event"] == "state" and line["engine"] == "e1" for line in lines), lines
