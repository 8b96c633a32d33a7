"""The screenshots of docs/img (docs/dashboard.md, README.md), of a realistic node:

    python -m tests.dashboard_shots [--run-s 240] [--out docs/img]

Node ``gpu-01`` runs four managed simulators (SGLang, vLLM leaking a little memory,
llama.cpp, Ollama with two models) and one adopted TGI; node ``gpu-02``, its push peer, one
adopted vLLM. After ``--run-s`` seconds (the charts fill), llama.cpp is stopped and TGI's
``/health`` answers 500, and a headless Chromium (tests/cdp.py) takes ``dashboard.png`` of
gpu-01's page, then ``dashboard-drawer.png`` with vLLM's drawer open.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx2
import trio
from tests.cdp import open_browser
from tests.managed import free_port, wait_state

from nvpair import service
from nvpair.config.settings import load_settings
from nvpair.sim import SimOptions, serve_sim

MANAGED = (  # name, kind, model, extra simulator flags
    ("sglang", "sglang", "deepseek-ai/DeepSeek-V4.1-Flash",
     ["--health-tick-s", "1.0", "--resident-mb", "300"]),
    ("vllm", "vllm", "Qwen/Qwen3-8B", ["--resident-mb", "200", "--leak-mb-per-s", "0.2"]),
    ("llamacpp", "llamacpp", "gemma3-270m", ["--resident-mb", "80"]),
    ("ollama", "ollama", "llama3.2:latest",
     ["--models", "llama3.2:latest,qwen3:0.6b", "--resident-mb", "120"]),
)


def node_config(tmp: Path, name: str, port: int, peer: tuple[str, int], body: str) -> Path:
    text = (f"listen = '127.0.0.1:{port}'\nnode = '{name}'\nlog_dir = '{tmp / name}'\n"
            f"{body}[[peers]]\nurl = 'http://127.0.0.1:{peer[1]}'\nname = '{peer[0]}'\n"
            f"[cluster]\ninterval_s = 1\ntoken_file = '{tmp / 'cluster-token'}'\n")
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def adopted(name: str, kind: str, port: int) -> str:
    return f"[[engines]]\nname = '{name}'\nkind = '{kind}'\nport = {port}\n"


async def main(run_s: float, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="nvpair-shots-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "cluster-token").write_text("shots-cluster-token\n")
        async with trio.open_nursery() as nursery:
            tgi = await nursery.start(serve_sim, SimOptions(
                kind="tgi", model="mistralai/Mistral-Small-3.2-24B-Instruct"))
            far = await nursery.start(serve_sim, SimOptions(
                kind="vllm", model="meta-llama/Llama-3.3-70B-Instruct"))
            ports = {"gpu-01": free_port(), "gpu-02": free_port()}
            body = ""
            for name, kind, model, extra in MANAGED:
                command = [sys.executable, "-m", "nvpair.sim", kind, "--model", "{model}",
                           "--host", "{host}", "--port", "{port}", "--no-control", *extra]
                body += (f"[[engines]]\nname = '{name}'\nkind = '{kind}'\nmodel = '{model}'\n"
                         f"port = {free_port()}\nmanaged = true\n"
                         f"command = {json.dumps(command)}\n")
            body += adopted("tgi", "tgi", tgi.port)
            one = load_settings(str(node_config(tmp, "gpu-01", ports["gpu-01"],
                                                ("gpu-02", ports["gpu-02"]), body)))
            two = load_settings(str(node_config(tmp, "gpu-02", ports["gpu-02"],
                                                ("gpu-01", ports["gpu-01"]),
                                                adopted("vllm-70b", "vllm", far.port))))
            first = await nursery.start(service.run, one)
            second = await nursery.start(service.run, two)
            with trio.fail_after(60):
                for name, *_ in MANAGED:
                    await wait_state(first.board, name, "ready")
            print(f"running {run_s:.0f} s for the charts: {first.url}/ui/", flush=True)
            await trio.sleep(run_s)
            async with httpx2.AsyncClient(base_url=first.url) as client:
                r = await client.post("/v1/engines/llamacpp/stop")
                assert r.status_code == 202, r.text
                r = await client.post(f"{tgi.control_url}/__sim/fault", json={
                    "mode": "error", "status": 500, "paths": ["/health"]})
                assert r.status_code == 200, r.text
            with trio.fail_after(30):
                await wait_state(first.board, "llamacpp", "stopped")
                await wait_state(first.board, "tgi", "stale", "unhealthy")
            async with open_browser() as browser:
                page = await browser.new_page(1440, 820)
                await page.goto(f"{first.url}/ui/")
                await page.wait_for("document.querySelector('#link').textContent === 'live' "
                                    "&& document.querySelector('#peers').textContent === "
                                    "'1 fresh' && document.querySelectorAll("
                                    "'#engines svg.spark polyline').length >= 4", within=15)
                await trio.sleep(11)  # one more read of the history: the ages settle
                await page.screenshot(str(out / "dashboard.png"))
                await page.evaluate("[...document.querySelectorAll('#engines tr')].find("
                                    "r => r.dataset.engine === 'vllm')"
                                    ".querySelector('button.name').click()")
                await page.wait_for("document.querySelector('#drawer-chart svg polyline.mem')"
                                    " && document.querySelector('#drawer-log')"
                                    ".textContent.length > 0", within=10)
                await page.screenshot(str(out / "dashboard-drawer.png"))
                assert page.exceptions == [] and page.console_errors == [], (
                    page.exceptions, page.console_errors)
            first.stop()
            second.stop()
            nursery.cancel_scope.cancel()
    print(f"wrote {out / 'dashboard.png'} and {out / 'dashboard-drawer.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    trio.run(main, args.run_s, args.out)
