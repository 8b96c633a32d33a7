"""nox sessions: tests, lint, bench, integration, chaos."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

SOURCES = [p for p in ("src", "tests", "benchmarks", "scripts", "noxfile.py") if Path(p).exists()]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (simulators over real sockets; no GPU, no real engine needed)."""
    # Two workers (CI has 2 cores): most of a test's time is a real clock waiting on real
    # processes, so two at once about halve the wall time. Then the tests marked alone, one
    # at a time with nothing beside them (tests/conftest.py); none selected is no failure.
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not integration and not alone", "-n", "2", *session.posargs)
    session.run("pytest", "-m", "not integration and alone", *session.posargs,
                success_codes=[0, 5])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, flake8-async (Trio's rules) and mypy."""
    session.install("-e", ".[test]", "ruff", "flake8", "flake8-async", "mypy")
    session.run("ruff", "check", *SOURCES)
    # Trio's rules (ASYNC1xx/2xx); the optional 9xx rules would forbid plain fast paths.
    session.run("flake8", "--select", "ASYNC1,ASYNC2", "--extend-ignore", "ASYNC114,ASYNC124",
                *[p for p in SOURCES if p != "noxfile.py"])
    session.run("mypy")


LITELLM = "1.108.7"


def litellm_venv(session: nox.Session) -> Path:
    """LiteLLM's proxy in a venv of its own (its pins are not ours), built once and cached."""
    venv = Path.home() / ".cache" / "nvpair" / f"litellm-{LITELLM}"
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    f"litellm[proxy]=={LITELLM}", external=True)
        (venv / ".complete").write_text(LITELLM + "\n")
    return venv


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: `nox -s bench` (full) or `nox -s bench -- --quick` (a few minutes)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "benchmarks", *session.posargs)
    # The cluster (peers) and router scenarios run as their own modules.
    quick = ["--quick"] if "--quick" in session.posargs else []
    session.run("python", "-m", "benchmarks.cluster", *quick)
    litellm = ["--litellm", "--litellm-venv", str(litellm_venv(session))]
    session.run("python", "-m", "benchmarks.router", *quick, *litellm)
    # Tracing off, on (sample 1.0) and to a hung collector, in the same rounds.
    session.run("python", "-m", "benchmarks.router", "--tracing", *quick)
    # Engines on demand: a warm request's added latency, a cold request's start overhead.
    session.run("python", "-m", "benchmarks.on_demand", *quick)
    # Reload: 1,024 engines, one changed: time to apply, loop stall, requests to the rest.
    session.run("python", "-m", "benchmarks.reload", *quick)
    # Multi-node groups: the failure timings (rank death, freeze, fencing, a rank's restart).
    session.run("python", "-m", "benchmarks.groups", *quick)
    # A restart of nvpair with 16 managed engines: on_exit = "keep" against "stop".
    session.run("python", "-m", "benchmarks.restart", *quick)
    if not quick:  # the same against the vLLM simulator (an engine-like, costly upstream)
        session.run("python", "-m", "benchmarks.router", "--upstream", "sim", *litellm)
    # A sleeping model's wake against a cold start, with the real llama-server: only where
    # `nox -s integration` (scripts/llama_server.py provide) has cached it; it is not built here.
    if llama_server_cached():
        session.run("python", "-m", "benchmarks.wake_real", *quick)
    else:
        session.log("benchmarks.wake_real skipped: no cached llama-server "
                    "(python scripts/llama_server.py provide)")


def llama_server_cached() -> bool:
    """Whether scripts/llama_server.py has the binary and the model in its cache."""
    done = subprocess.run([sys.executable, "scripts/llama_server.py", "paths"],
                          capture_output=True, check=False)
    return done.returncode == 0


@nox.session
def chaos(session: nox.Session) -> None:
    """Containment: hostile engines, peers, etcd and clients, SIGKILL and restart (minutes)."""
    session.install("-e", ".[test]", "schemathesis")
    session.run("python", "-m", "benchmarks.chaos", *session.posargs)
    # Schemathesis, a fuzzer that is not ours, against the API's own OpenAPI document
    session.run("python", "-m", "benchmarks.chaos_fuzz")


@nox.session
def integration(session: nox.Session) -> None:
    """Tests against a real llama.cpp llama-server (built once, then cached)."""
    session.install("-e", ".[test]")
    session.run("python", "scripts/llama_server.py", "provide")
    session.run("pytest", "tests/integration", "-m", "integration", *session.posargs,
                env={"NVPAIR_INTEGRATION": "1"})
