"""What every simulated engine shares: routing, the request pipeline and the engine's answers.

The pipeline for each request on the engine port: accounting, injected faults, the kind's
own gate (llama.cpp's "Loading model", vLLM's loop lag), the API key, then the route.
A kind subclasses :class:`Engine`, adds its routes and overrides the answers that differ.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import trio

from nvpair.sim.faults import DEFAULT_MISMATCH_MODEL, DEFAULT_SLOW_S
from nvpair.sim.garbage import send_garbage
from nvpair.sim.http import Reply, Request
from nvpair.sim.options import SimOptions
from nvpair.sim.sleep import SimSleep
from nvpair.sim.state import SimState

Route = Callable[[Request, Reply], Awaitable[None]]


class Router:
    """Exact paths, plus paths ending in one ``{param}`` segment."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Route]] = {}
        self._param: list[tuple[str, str, dict[str, Route]]] = []

    def add(self, methods: str, path: str, route: Route) -> None:
        """``methods`` is comma-separated, for example ``"GET,HEAD"``."""
        if path.endswith("}"):
            prefix, _, name = path[:-1].rpartition("{")
            table: dict[str, Route] = {}
            self._param.append((prefix, name, table))
        else:
            table = self._exact.setdefault(path, {})
        for method in methods.split(","):
            table[method.strip()] = route

    def match(self, request: Request) -> tuple[Route | None, bool]:
        """(route or None, whether the path exists with another method)."""
        table = self._exact.get(request.path)
        if table is None:
            for prefix, name, candidate in self._param:
                rest = request.path[len(prefix):]
                if request.path.startswith(prefix) and rest:
                    request.params[name] = rest
                    table = candidate
                    break
        if table is None:
            return None, False
        return table.get(request.method), True


class Engine:
    """Base of the simulated engines. ``__call__`` is the engine port's HTTP handler."""

    kind: ClassVar[str]
    #: llama.cpp: listening (with 503s) while loading; the others refuse connects.
    port_open_while_loading: ClassVar[bool] = False
    #: SGLang: still listening (with 503 on /health*) while stopping.
    listen_while_stopping: ClassVar[bool] = False
    #: SGLang: a warming phase (Starting) between loading and ready.
    has_warmup: ClassVar[bool] = False
    #: vLLM --headless: no HTTP listener at all.
    headless: ClassVar[bool] = False
    #: vLLM, TGI: the dead phase answers 503 for ``exit_after_dead_s``, then the process exits.
    #: Other kinds exit as soon as they are dead.
    serves_while_dead: ClassVar[bool] = False
    #: idle keep-alive connections are closed after this long (``options.idle_timeout_s``
    #: overrides it).
    keep_alive_s: ClassVar[float] = 30.0

    def __init__(self, options: SimOptions, state: SimState) -> None:
        self.options = options
        self.state = state
        #: the engine port number (set once reserved).
        self.port = options.port
        #: the engine's sleep, for the kinds and options that have one (nvpair.sim.sleep)
        self.sleep: SimSleep | None = self.make_sleep()
        self.router = Router()
        self.add_routes(self.router)

    # -- what a kind provides ------------------------------------------------------------------

    def add_routes(self, router: Router) -> None:
        """Register the kind's routes."""

    def status(self) -> dict[str, Any]:
        """Kind-specific state for the stats (status flags, loaded models, ...)."""
        return {}

    def make_sleep(self) -> SimSleep | None:
        """The kind's sleep with these options (None: it cannot sleep)."""
        return None

    def garbled(self) -> bool:
        """Whether it generates nonsense now (vLLM woken from a level-2 sleep without its
        weights loaded again)."""
        return False

    async def before_route(self, request: Request, reply: Reply) -> bool:
        """A gate in front of auth and routing; True when it answered."""
        await trio.lowlevel.checkpoint()
        return False

    def prepare(self, request: Request, reply: Reply) -> None:
        """Called first for every request: set up the reply (header fields, closing)."""

    def auth_exempt(self, path: str) -> bool:
        return False

    def authorized(self, request: Request, key: str) -> bool:
        """Whether the request carries the API key ``key`` (default: ``Bearer <key>``)."""
        return request.header("authorization") == f"Bearer {key}"

    async def unauthorized(self, reply: Reply) -> None:
        await reply.send_json(401, {"error": "Unauthorized"})

    async def not_found(self, request: Request, reply: Reply) -> None:
        await reply.send_json(404, {"detail": "Not Found"})

    async def method_not_allowed(self, request: Request, reply: Reply) -> None:
        await reply.send_json(405, {"detail": "Method Not Allowed"})

    async def error(self, reply: Reply, status: int, message: str) -> None:
        """The kind's error envelope."""
        await reply.send_json(status, {"error": {
            "message": message, "type": _error_type(status), "param": None, "code": status,
        }})

    async def unhealthy(self, request: Request, reply: Reply) -> None:
        """What an unhealthy engine answers (the ``flap`` fault's bad half)."""
        await self.error(reply, 503, "unhealthy")

    def on_injected_error(self, path: str) -> None:
        """The ``error`` fault just answered ``path``."""

    async def admit(self, request: Request, reply: Reply, model: object) -> str | None:
        """An inference request for ``model``: the model name to answer with, or None when
        this already answered (unknown model, overload)."""
        await trio.lowlevel.checkpoint()
        return self.served_model

    @asynccontextmanager
    async def inference_slot(self) -> AsyncIterator[None]:
        """Held while a generation runs (llama.cpp: one of ``np`` slots)."""
        await trio.lowlevel.checkpoint()
        yield
        await trio.lowlevel.checkpoint()

    async def shutdown(self) -> None:
        """What SIGTERM does once the lifecycle stops: ends with ``request_exit``."""
        self.state.set_phase("stopping")
        await trio.sleep(self.options.stop_s if self.listen_while_stopping else 0.0)
        self.state.request_exit(0)

    # -- shared helpers ----------------------------------------------------------------------

    @property
    def served_model(self) -> str:
        fault = self.state.fault("mismatch")
        if fault is not None:
            return fault.model or DEFAULT_MISMATCH_MODEL
        return self.options.served

    def wants_listening(self) -> bool:
        if self.headless or self.state.fault("refuse") is not None:
            return False
        if self.state.phase == "loading":
            return self.port_open_while_loading
        if self.state.phase == "stopping":
            return self.listen_while_stopping
        return True

    async def read_json_object(self, request: Request, reply: Reply) -> dict[str, Any] | None:
        """The body as a JSON object, or None after answering 400."""
        await trio.lowlevel.checkpoint()
        try:
            body = request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            await self.error(reply, 400, f"invalid JSON body: {exc}")
            return None
        if body is None:
            body = {}
        if not isinstance(body, dict):
            await self.error(reply, 400, "the body must be a JSON object")
            return None
        return body

    async def send_prometheus(self, reply: Reply, text: str) -> None:
        await reply.send(200, text.encode(), content_type="text/plain; version=0.0.4")

    # -- the pipeline --------------------------------------------------------------------------

    async def __call__(self, request: Request, reply: Reply) -> None:
        accounting = self.state.accounting
        accounting.begin(request.path)
        started = trio.current_time()
        accounted = False

        def account(reply: Reply) -> None:
            nonlocal accounted
            if not accounted:
                accounted = True
                accounting.end(
                    request.path, reply.status, aborted=reply.aborted,
                    reset=reply.reset_requested, elapsed=trio.current_time() - started,
                )

        reply.on_complete = account
        self.prepare(request, reply)
        try:
            await self._pipeline(request, reply)
        finally:
            account(reply)

    async def _pipeline(self, request: Request, reply: Reply) -> None:
        if await self._apply_faults(request, reply):
            return
        if await self.before_route(request, reply):
            return
        key = self.options.api_key
        if key and not self.auth_exempt(request.path) and not self.authorized(request, key):
            await self.unauthorized(reply)
            return
        route, known = self.router.match(request)
        if route is not None:
            await route(request, reply)
        elif known:
            await self.method_not_allowed(request, reply)
        else:
            await self.not_found(request, reply)

    async def _apply_faults(self, request: Request, reply: Reply) -> bool:
        """Apply the injected faults matching this path; True when that answered."""
        await trio.lowlevel.checkpoint()
        state, path = self.state, request.path
        crash = state.fault("crash", path)
        if crash is not None and crash.paths:
            state.request_exit(1 if crash.exit_code is None else crash.exit_code, hard=True)
            await trio.sleep_forever()
        if state.fault("reset", path) is not None:
            reply.reset()
            return True
        garbage = state.fault("garbage", path)
        if garbage is not None:
            await send_garbage(garbage, request, reply)
            return True
        if state.fault("hang", path) is not None:
            await trio.sleep_forever()
        slow = state.fault("slow", path)
        if slow is not None:
            await trio.sleep(DEFAULT_SLOW_S if slow.seconds is None else slow.seconds)
        error = state.fault("error", path)
        if error is not None:
            self.on_injected_error(path)
            await self.error(reply, error.status or 500, "injected fault")
            return True
        flap = state.fault("flap", path)
        if flap is not None and state.faults.flap_unhealthy(trio.current_time()):
            if flap.status is not None:
                await self.error(reply, flap.status, "injected flap")
            else:
                await self.unhealthy(request, reply)
            return True
        if state.fault("stall", path) is not None:
            reply.stall = True
        return False


def _error_type(status: int) -> str:
    return {
        400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
        404: "NotFoundError", 429: "RateLimitError", 503: "ServiceUnavailableError",
    }.get(status, "InternalServerError")


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
