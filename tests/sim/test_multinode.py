"""Multi-node: rank 0 becomes ready only after its workers, the SGLang rank >= 1 stand-in, the
vLLM headless worker, and what each side does when the other goes away."""

from __future__ import annotations

import httpx2
import pytest
import trio
import trio.testing


async def test_sglang_head_waits_for_its_worker(start_sim, http):
    with trio.fail_after(10):
        head = await start_sim("sglang", ready=False, nnodes=2, node_rank=0)
        assert head.dist_port is not None
        await trio.testing.wait_all_tasks_blocked()
        assert head.phase == "loading" and not head.listening  # no worker yet
        with pytest.raises(httpx2.ConnectError):
            await http(head).get("/ping")

        worker = await start_sim("sglang", ready=False, nnodes=2, node_rank=1,
                                 dist_init_addr=head.dist_addr, load_s=0.2)
        await worker.wait_phase("ready")
        await head.wait_phase("ready")
        await head.settle()
        await worker.settle()
        assert head.stats().engine["workers_ready"] == [1]
        assert (await http(head).get("/ping")).status_code == 200

        # the rank >= 1 dummy health server
        client = http(worker)
        for path in ("/health", "/health_generate", "/ping"):
            response = await client.get(path)
            assert (response.status_code, response.content) == (200, b""), path
        assert (await client.get("/v1/models")).status_code == 404
        assert (await client.get("/model_info")).status_code == 404


async def test_worker_loss_hangs_the_head(start_sim, nursery):
    with trio.fail_after(10):
        head = await start_sim("sglang", ready=False, nnodes=2, node_rank=0)
        worker = await start_sim("sglang", ready=False, nnodes=2, node_rank=1,
                                 dist_init_addr=head.dist_addr)
        await head.wait_phase("ready")
        worker.stop()
        assert await worker.wait_exited() == 0
        await head.wait_phase("hung")


async def test_head_shutdown_ends_the_worker_cleanly(start_sim):
    with trio.fail_after(10):
        head = await start_sim("vllm", ready=False, nnodes=2, node_rank=0)
        worker = await start_sim("vllm", ready=False, nnodes=2, node_rank=1, headless=True,
                                 dist_init_addr=head.dist_addr)
        await head.wait_phase("ready")
        assert worker.port == 0 and not worker.listening
        head.stop()
        assert await head.wait_exited() == 0
        assert await worker.wait_exited() == 0


async def test_head_crash_fails_the_worker(start_sim):
    with trio.fail_after(10):
        head = await start_sim("vllm", ready=False, nnodes=2, node_rank=0)
        worker = await start_sim("vllm", ready=False, nnodes=2, node_rank=1, headless=True,
                                 dist_init_addr=head.dist_addr)
        await head.wait_phase("ready")
        head.set_fault("crash", exit_code=5)
        assert await head.wait_exited() == 5
        assert await worker.wait_exited() == 1


async def test_worker_started_first_waits_for_the_head(start_sim):
    with trio.fail_after(10):
        # a free port for the rendezvous, which the head binds only later
        probe = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = probe[0].socket.getsockname()[1]
        await probe[0].aclose()
        addr = f"127.0.0.1:{port}"
        worker = await start_sim("sglang", ready=False, nnodes=2, node_rank=1,
                                 dist_init_addr=addr)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert worker.phase == "loading"
        head = await start_sim("sglang", ready=False, nnodes=2, node_rank=0,
                               dist_init_addr=addr)
        await head.wait_phase("ready")
        await worker.wait_phase("ready")
