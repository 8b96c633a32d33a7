"""One probe request and what its answer means. No loops and no timeouts here: the loop that
owns a probe's policy applies its deadline (see prober.py)."""

from __future__ import annotations

from typing import Any

import httpx2
import msgspec
import trio

from nvpair.errors import ProbeError
from nvpair.manifest import ModelsFormat, ProbeSpec
from nvpair.snapshot import Identity, Model
from nvpair.streams import close_early

MAX_BODY = 4 * 1024 * 1024


class Answer(msgspec.Struct, frozen=True):
    status: int
    body: bytes
    latency_ms: float


async def request(
    client: httpx2.AsyncClient, spec: ProbeSpec, path: str, *, api_key: str | None
) -> Answer:
    """Send one probe request; raise ProbeError for no answer or an unexpected status."""
    headers = {}
    if api_key and spec.needs_api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if client.is_closed:
        raise ProbeError("error", "the engine's probe client is closed (engine stopping)")
    started = trio.current_time()
    for attempt in (1, 2):
        try:
            async with client.stream(spec.method, path, headers=headers) as response:
                body = await _read_capped(response, f"{spec.method} {path}")
        except httpx2.ConnectError as exc:
            raise ProbeError("refused", f"cannot connect: {_reason(exc)}") from None
        except httpx2.RemoteProtocolError as exc:
            # A pooled keep-alive connection the engine closed just as we reused it: the
            # request never reached the engine, so one immediate retry is safe for a probe.
            if attempt == 1:
                continue
            raise ProbeError("error", f"protocol error: {_reason(exc)}") from None
        except httpx2.TimeoutException:
            raise ProbeError("timeout", "no answer within the client's timeout") from None
        except httpx2.HTTPError as exc:
            raise ProbeError("error", f"{type(exc).__name__}: {_reason(exc)}") from None
        break
    latency_ms = (trio.current_time() - started) * 1000
    if response.status_code not in spec.expect_status:
        raise ProbeError(
            "status",
            f"{spec.method} {path} answered {response.status_code}{_excerpt(body)}",
            http_status=response.status_code,
        )
    return Answer(status=response.status_code, body=body, latency_ms=latency_ms)


async def _read_capped(response: httpx2.Response, what: str) -> bytes:
    """The body, read as it comes and never more than MAX_BODY of it (an answer that big
    is refused without being held in memory)."""
    chunks: list[bytes] = []
    size = 0
    raw = response.aiter_bytes()
    async for chunk in raw:
        size += len(chunk)
        if size > MAX_BODY:
            await close_early(raw)
            raise ProbeError("error", f"{what} answered more than {MAX_BODY // 2**20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def _excerpt(body: bytes) -> str:
    text = body[:160].decode("utf-8", "replace").strip()
    return f": {text}" if text else ""


def _json(body: bytes, what: str) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise ProbeError("body", f"{what}: the answer is not JSON{_excerpt(body)}") from None


def pointer(doc: Any, ptr: str) -> Any:
    """Resolve a JSON pointer (RFC 6901); None where the path does not exist."""
    if ptr in ("", "/"):
        return doc
    for raw in ptr.lstrip("/").split("/"):
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, dict):
            doc = doc.get(key)
        elif isinstance(doc, list) and key.isdigit() and int(key) < len(doc):
            doc = doc[int(key)]
        else:
            return None
    return doc


def parse_identity(body: bytes, spec: ProbeSpec, kind: str) -> tuple[Identity, tuple[str, ...]]:
    """The identity an engine reports, and every model name it gave (for matching).

    Raises ProbeError("mismatch") when the body lacks the keys that this kind always has.
    """
    try:
        doc = _json(body, f"GET {spec.path}")
    except ProbeError:
        raise ProbeError("mismatch", f"does not look like {kind}: GET {spec.path} "
                                     f"is not JSON{_excerpt(body)}") from None
    if not isinstance(doc, dict):
        raise ProbeError("mismatch", f"does not look like {kind}: GET {spec.path} is not an object")
    missing = [k for k in spec.require_keys if k not in doc]
    if missing:
        raise ProbeError(
            "mismatch",
            f"does not look like {kind}: GET {spec.path} lacks {', '.join(missing)}",
        )
    names = tuple(str(v) for p in spec.model_pointers if (v := pointer(doc, p)) not in (None, ""))
    version = pointer(doc, spec.version_pointer) if spec.version_pointer else None
    return Identity(model=names[0] if names else None,
                    version=None if version is None else str(version)), names


def parse_models(body: bytes, fmt: ModelsFormat, path: str) -> tuple[Model, ...]:
    doc = _json(body, f"GET {path}")
    if fmt == "ollama_tags":
        items = doc.get("models") if isinstance(doc, dict) else None
        key, owner = "name", "ollama"
    else:
        items = doc.get("data") if isinstance(doc, dict) else None
        key, owner = "id", ""
    if items is None:  # Ollama answers "data": null when it has no models
        return ()
    if not isinstance(items, list):
        raise ProbeError("body", f"GET {path}: expected a list of models")
    models = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(key), str):
            raise ProbeError("body", f"GET {path}: a model entry has no string {key!r}")
        created = item.get("created")
        models.append(
            Model(
                id=item[key],
                created=created if isinstance(created, int) else 0,
                owned_by=str(item.get("owned_by") or owner),
            )
        )
    return tuple(models)


def same_model(expected: str, served: str) -> bool:
    """Whether a served name is the expected model: equal, or equal after the path."""
    a, b = (_plain(x) for x in (expected, served))
    if a == b:
        return True
    tail_a, tail_b = a.rstrip("/").rsplit("/", 1)[-1], b.rstrip("/").rsplit("/", 1)[-1]
    return tail_a == tail_b


def _plain(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(":latest")
