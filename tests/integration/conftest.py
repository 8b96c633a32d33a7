"""Fixtures that run a real llama.cpp ``llama-server`` (built by ``scripts/llama_server.py``).

Without a cached build the integration tests are skipped, unless ``NVPAIR_INTEGRATION=1``: then
they fail, so that CI cannot pass by silently skipping them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from tests.integration.llamacpp_process import (
    LlamaAssets,
    LlamaServer,
    ServerFactory,
    find_assets,
    run_llama_server,
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


@pytest.fixture
def llama_server_factory(llama_assets: LlamaAssets, llama_log_dir: Path) -> ServerFactory:
    """``async with llama_server_factory(api_key=..., metrics=..., wait_ready=...) as srv``."""

    def factory(**kwargs: Any) -> AbstractAsyncContextManager[LlamaServer]:
        return run_llama_server(llama_assets, llama_log_dir, **kwargs)

    return factory


@pytest.fixture
async def llama_server(llama_server_factory: ServerFactory) -> AsyncIterator[LlamaServer]:
    """A ready llama-server: ``-c 1024 -t 2 -np 2 --metrics --alias gemma3-270m``."""
    async with llama_server_factory() as server:
        yield server
