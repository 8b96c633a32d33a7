"""Fixtures that run a real llama.cpp ``llama-server`` (built by ``scripts/llama_server.py``) or
nvpair's llama.cpp simulator with the same flags.

Tests that take ``llama_server_factory`` or ``llama_server`` run twice: ``[real]`` against the
real server (marked ``integration``, so ``nox -s integration`` runs them) and ``[sim]`` against
the simulator (no mark, so the normal ``nox -s tests`` runs them and the simulator cannot drift).

Without a cached build the real variants are skipped, unless ``NVPAIR_INTEGRATION=1``: then
they fail, so that CI cannot pass by silently skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from tests.integration.llamacpp_process import (
    LlamaAssets,
    LlamaServer,
    ServerFactory,
    SharedServers,
    Variant,
    find_assets,
    run_llama_server,
    run_llamacpp_sim,
)


def integration_required() -> bool:
    return os.environ.get("NVPAIR_INTEGRATION", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def llama_assets() -> LlamaAssets:
    """The cached llama-server binary and GGUF model; skip (or fail) if there are none."""
    assets, reason = find_assets()
    if assets is None:
        if integration_required():
            pytest.fail(f"NVPAIR_INTEGRATION is set, but {reason}", pytrace=False)
        pytest.skip(reason)
    return assets


@pytest.fixture
def llama_log_dir(tmp_path: Path) -> Path:
    return tmp_path / "llama-logs"


@pytest.fixture(params=[pytest.param("real", marks=pytest.mark.integration), "sim"])
def variant(request: pytest.FixtureRequest) -> Variant:
    """Which llama.cpp server the test runs against."""
    value: Variant = request.param
    return value


@pytest.fixture
def llama_server_factory(
    variant: Variant, request: pytest.FixtureRequest, llama_log_dir: Path
) -> ServerFactory:
    """``async with llama_server_factory(api_key=..., metrics=..., wait_ready=...) as srv``:
    a real llama-server or the simulator, per ``variant``."""
    if variant == "real":
        assets: LlamaAssets = request.getfixturevalue("llama_assets")

        def real(**kwargs: Any) -> AbstractAsyncContextManager[LlamaServer]:
            return run_llama_server(assets, llama_log_dir, **kwargs)

        return real

    def sim(**kwargs: Any) -> AbstractAsyncContextManager[LlamaServer]:
        return run_llamacpp_sim(llama_log_dir, **kwargs)

    return sim


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServers]:
    servers = SharedServers(tmp_path_factory.mktemp("llama-shared"))
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture
def llama_server(
    variant: Variant, request: pytest.FixtureRequest, shared_servers: SharedServers
) -> LlamaServer:
    """A ready server with the default flags (``-c 1024 -t 1 -np 2 --metrics --alias
    gemma3-270m --no-webui``), shared by the tests that only read, per ``variant``. Tests
    must leave every slot idle."""
    assets = request.getfixturevalue("llama_assets") if variant == "real" else None
    return shared_servers.get(variant, assets)


@pytest.fixture
def real_llama_server(llama_assets: LlamaAssets, shared_servers: SharedServers) -> LlamaServer:
    """The shared real llama-server (for nvpair against the real engine)."""
    return shared_servers.get("real", llama_assets)
