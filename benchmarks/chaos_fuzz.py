"""Chaos: Schemathesis, a fuzzer that is not ours, against a live ``nvpair serve``.

nvpair serves its API's OpenAPI document (``GET /openapi.json``, nvpair.openapi). This
starts two simulators and nvpair with a token over them and a third it runs itself (the
router on, peers on with one peer that is down), and runs
``schemathesis run`` against that document with the token: every operation gets a bounded
number of generated requests, valid and invalid, and every answer is checked for a server
error (5xx), a status the document does not list, a content type it does not list, and a
body that does not match its schema. Then nvpair's log is searched for tracebacks.

``GET /v1/events`` is left out: it is a stream that never ends by design, which a fuzzer
can only time out on (tests/test_sse.py covers it).

    python -m benchmarks.chaos_fuzz [--max-examples N]

Prints the counts and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.procs import PY, Procs, engine_toml, free_port, start_nvpair, start_sim

#: no 5xx; status, content type and body as documented; a request the document calls
#: invalid is refused (4xx); a request without the token is refused (401)
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection", "ignored_auth")
#: generated requests per operation (23 operations on 2 busy cores: 16 s at 50, 94 s at 100,
#: most of it long-polls that wait their wait_s)
MAX_EXAMPLES = 50
#: the run is over by then, or it has failed (a hung answer, say)
RUN_LIMIT_S = 300
TOKEN = "fuzz-token-not-secret"
CLUSTER_TOKEN = "fuzz-cluster-token-not-secret"
#: A routed request's 5xx is the engine's, documented: its own answer passed through (the
#: llama-server simulator answers 501 to embeddings, as the real one does), or nvpair's
#: 502/503/504 for an engine that failed or is not ready (the fuzzer stops and drains
#: them). A 500 of nvpair's own comes with a traceback in its log, which is counted.
#: Anywhere else a 5xx is a failure.
#: The tokens go in the config file, not on the command line (argv is anyone's to read);
#: a peer's advert takes the cluster token.
CONFIG = """
headers = {{ Authorization = "Bearer {token}" }}

[[operations]]
include-path = "/v1/peers/adverts"
headers = {{ Authorization = "Bearer {cluster_token}" }}

[[operations]]
include-path-regex = "^/v1/(chat/completions|completions|embeddings|responses|rerank|score)$"
checks.not_a_server_error.expected-statuses = ["2XX", "3XX", "4XX", "5XX"]
"""


def schemathesis() -> str:
    found = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(found).exists():
        raise SystemExit("chaos_fuzz: schemathesis is not installed (pip install schemathesis)")
    return found


def counts(junit: Path) -> dict[str, int]:
    """Operations, failed and errored ones, from Schemathesis' JUnit report."""
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    return {"operations": len(cases),
            "failed": sum(1 for c in cases if c.find("failure") is not None),
            "errors": sum(1 for c in cases if c.find("error") is not None)}


def failures(junit: Path) -> list[str]:
    root = ET.parse(junit).getroot()
    out = []
    for case in root.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            out.append(f"{case.get('name')}: {text.strip()[:1500]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=MAX_EXAMPLES)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nvpair-fuzz-") as tmp, Procs(Path(tmp)) as procs:
        work = Path(tmp)
        (work / "token").write_text(TOKEN)
        _, vllm, _ = start_sim(procs, "sim-vllm", "vllm", model="fuzz-vllm")
        _, llama, _ = start_sim(procs, "sim-llama", "llamacpp", model="fuzz-llama")
        # and one nvpair runs itself: its logs answer, and stop and restart are real
        managed = [PY, "-m", "nvpair.sim", "vllm", "--model", "{model}", "--host", "{host}",
                   "--port", "{port}", "--no-control", "--load-s", "0", "--warmup-s", "0"]
        engines = (engine_toml("v", "vllm", vllm, "fuzz-vllm")
                   + engine_toml("l", "llamacpp", llama, "fuzz-llama")
                   + engine_toml("m", "vllm", free_port(), "fuzz-managed",
                                 f"managed = true\ncommand = {json.dumps(managed)}\n"))
        # peers on, with one peer that is down (nothing listens there): the peer routes
        (work / "cluster-token").write_text(CLUSTER_TOKEN)
        top = (f"token_file = '{work / 'token'}'\n[cluster]\n"
               f"token_file = '{work / 'cluster-token'}'\n"
               f"[[peers]]\nurl = 'http://127.0.0.1:{free_port()}'\n")
        proc, url, _ = start_nvpair(procs, "nvpair", engines, top=top)
        junit = work / "junit.xml"
        config = work / "schemathesis.toml"
        config.write_text(CONFIG.format(token=TOKEN, cluster_token=CLUSTER_TOKEN))
        argv = [schemathesis(), "--config-file", str(config), "run", f"{url}/openapi.json",
                "--checks", ",".join(CHECKS), "--max-examples", str(args.max_examples),
                "--seed", str(args.seed), "--exclude-path", "/v1/events",
                "--phases", "examples,coverage,fuzzing", "--request-timeout", "40",
                "--generation-database", "none", "--no-color", "--workers", "1",
                "--report", "junit", "--report-junit-path", str(junit)]
        print("chaos_fuzz:", " ".join(argv[1:]), flush=True)
        started = time.monotonic()
        try:
            run = subprocess.run(argv, capture_output=True, text=True, cwd=work,  # (its cache)
                                 env={**os.environ, "NO_COLOR": "1"}, check=False,
                                 timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired as exc:
            print(f"chaos_fuzz: schemathesis still ran after {RUN_LIMIT_S} s:\n"
                  f"{(exc.stdout or b'')[-3000:]!r}")
            return 1
        took = time.monotonic() - started
        alive = proc.alive()
        procs.close()
        log = proc.log.read_text(errors="replace") if proc.log else ""
        tracebacks = log.count("Traceback (most recent call last)")
        found = counts(junit) if junit.exists() else {"operations": 0, "failed": 0,
                                                       "errors": 0}
        tail = [line for line in run.stdout.splitlines() if line.strip()][-30:]
        print("\n".join(tail))
        print(f"chaos_fuzz: {found['operations']} operations, {args.max_examples} examples "
              f"each at most, {took:.0f} s: {found['failed']} failed, {found['errors']} "
              f"errored, {tracebacks} tracebacks in nvpair's log, nvpair "
              f"{'alive' if alive else 'DEAD'} at the end (schemathesis exit {run.returncode})")
        ok = (run.returncode == 0 and not found["failed"] and not found["errors"]
              and not tracebacks and alive and found["operations"] > 0)
        if not ok:
            for text in (failures(junit) if junit.exists() else [])[:20]:
                print("---", text)
            if tracebacks:
                print("--- nvpair's log:\n" + log[-6000:])
            if not found["operations"]:
                print(run.stdout[-4000:], run.stderr[-4000:])
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
