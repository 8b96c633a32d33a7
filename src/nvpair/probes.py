"""One probe request and what its answer means. No loops and no timeouts here: the loop that
owns a probe's policy applies its deadline (see prober.py)."""

from __future__ import annotations

import re
from typing import Any

import httpx2
import msgspec
import trio

from nvpair.decoding import decode_json, excerpt
from nvpair.errors import ProbeError
from nvpair.manifest import ModelsFormat, ProbeSpec
from nvpair.snapshot import Identity, Model
from nvpair.streams import close_early

MAX_BODY = 4 * 1024 * 1024
#: at most this many models of one engine are listed; the rest are counted as left out.
MAX_MODELS = 10_000
#: what peers accept (src/nvpair/peers/advert.py: ids are ``Text``, 512 characters); a
#: longer id is left out, so one odd model never makes peers refuse the node's advert.
MAX_ID_CHARS = 512
#: ``owned_by`` is cut to this many characters (peers accept 512).
MAX_OWNER_CHARS = 128
INT64 = (-(2**63), 2**63 - 1)
#: C0 and C1 control characters, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


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
    # A generating request may have reached the engine even when the answer broke: it is
    # never sent twice.
    attempts = (1,) if generates(spec, path) else (1, 2)
    for attempt in attempts:
        try:
            async with client.stream(spec.method, path, headers=headers) as response:
                body = await _read_capped(response, f"{spec.method} {path}")
        except httpx2.ConnectError as exc:
            raise ProbeError("refused", f"cannot connect: {_reason(exc)}") from None
        except httpx2.RemoteProtocolError as exc:
            # A pooled keep-alive connection the engine closed just as we reused it: the
            # request never reached the engine, so one immediate retry is safe for a probe.
            if attempt < len(attempts):
                continue
            raise ProbeError("error", f"{spec.method} {path}: protocol error: {_reason(exc)}"
                             ) from None
        except httpx2.TimeoutException:
            raise ProbeError("timeout", "no answer within the client's timeout") from None
        except httpx2.HTTPError as exc:
            raise ProbeError("error", f"{spec.method} {path}: {type(exc).__name__}: "
                                      f"{_reason(exc)}") from None
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


def generates(spec: ProbeSpec, path: str) -> bool:
    """Whether asking ``path`` for this probe runs a generation on the engine."""
    if path == spec.path:
        return spec.cost == "generating"
    return path == spec.fallback_path and spec.fallback_cost == "generating"


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def _excerpt(body: bytes) -> str:
    return excerpt(body)


def _json(body: bytes, what: str) -> Any:
    """``body`` as JSON; any decode failure (nesting past the decoder's depth and bytes that
    are not UTF-8 included) is a one-line ``ProbeError("body")``."""
    return decode_json(body, what)


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
    doc = decode_json(body, f"GET {spec.path}", error=lambda message: ProbeError(
        "mismatch", f"does not look like {kind}: {message}"))
    if not isinstance(doc, dict):
        raise ProbeError("mismatch", f"does not look like {kind}: GET {spec.path} is not an object")
    missing = [k for k in spec.require_keys if k not in doc]
    if missing:
        raise ProbeError(
            "mismatch",
            f"does not look like {kind}: GET {spec.path} lacks {', '.join(missing)}",
        )
    names = tuple(n for p in spec.model_pointers if (n := _scalar(pointer(doc, p))))
    version = _scalar(pointer(doc, spec.version_pointer)) if spec.version_pointer else None
    return Identity(model=names[0] if names else None, version=version or None), names


def _scalar(value: Any) -> str | None:
    """A name or version as text: strings and numbers only (a list or an object is not a
    name), at most MAX_ID_CHARS characters; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    text = value if isinstance(value, str) else repr(value)
    return text[:MAX_ID_CHARS]


class Listing(msgspec.Struct, frozen=True):
    """The models an engine listed, and those left out (``left_out``, ``why`` in words)."""

    models: tuple[Model, ...]
    left_out: int = 0
    why: str | None = None


def parse_models(body: bytes, fmt: ModelsFormat, path: str) -> tuple[Model, ...]:
    return parse_listing(body, fmt, path).models


#: a model list is decoded in two steps, so no list costs more than MAX_MODELS entries of
#: work on the event loop: the top level with its entries left as raw JSON (a scan in C),
#: then only as many entries as are needed to list MAX_MODELS (150,000 entries decoded and
#: checked one by one held the loop for about 100 ms; now a few ms).
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENTRIES = msgspec.json.Decoder(list[msgspec.Raw] | None)
_ENTRY = msgspec.json.Decoder()


def parse_listing(body: bytes, fmt: ModelsFormat, path: str) -> Listing:
    """The model list. Entries that peers would refuse are left out one by one and counted
    (an id that is not a string, empty, over MAX_ID_CHARS or with control characters; beyond
    MAX_MODELS); ``created`` that is not an int64 is 0; ``owned_by`` is cut to
    MAX_OWNER_CHARS. Entries past the cap are counted as over it without being looked at.
    Raises ProbeError only for a body that is not a model list at all."""
    what = f"GET {path}"
    try:  # (the raw entries are not checked by the first step)
        body.decode("utf-8")
    except UnicodeDecodeError:
        _json(body, what)  # says "is not UTF-8"
        raise
    key, owner, field = (("name", "ollama", "models") if fmt == "ollama_tags"
                         else ("id", "", "data"))
    try:
        top = _TOP.decode(body)
    except msgspec.ValidationError:  # JSON, but not an object: no list of models in it
        _json(body, what)  # (a body that is not JSON at all says so)
        return Listing(models=())
    except Exception:  # every decode failure is one line (decoding.decode_json)
        _json(body, what)
        raise
    raw = top.get(field)
    if raw is None:
        return Listing(models=())
    try:
        entries = _ENTRIES.decode(raw)
    except msgspec.ValidationError:
        raise ProbeError("body", f"{what}: expected a list of models") from None
    except Exception:
        _json(body, what)
        raise
    if entries is None:  # Ollama answers "data": null when it has no models
        return Listing(models=())
    models: list[Model] = []
    dropped: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if len(models) >= MAX_MODELS:  # the rest is not even looked at
            over = f"over the cap of {MAX_MODELS:,} models"
            dropped[over] = dropped.get(over, 0) + len(entries) - index
            break
        try:
            item = _ENTRY.decode(entry)
        except (RecursionError, msgspec.DecodeError):
            item = None  # an entry nested past the decoder's depth: not an object
        why = _unlistable(item, key)
        if why is not None:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        created = item.get("created")
        owned_by = item.get("owned_by")
        models.append(Model(
            id=item[key],
            created=created if _is_int64(created) else 0,
            owned_by=(owned_by if isinstance(owned_by, str) and owned_by else owner)
            [:MAX_OWNER_CHARS],
        ))
    if not dropped:
        return Listing(models=tuple(models))
    left_out = sum(dropped.values())
    reasons = ", ".join(f"{n:,} {why}" for why, n in dropped.items())
    return Listing(models=tuple(models), left_out=left_out,
                   why=f"{what}: {left_out:,} of {len(entries):,} models left out ({reasons})")


def _unlistable(item: Any, key: str) -> str | None:
    """Why a model entry cannot be listed, or None."""
    if not isinstance(item, dict):
        return "not an object"
    name = item.get(key)
    if not isinstance(name, str) or not name:
        return f"without a string {key!r}"
    if len(name) > MAX_ID_CHARS:
        return f"with an {key} over {MAX_ID_CHARS} characters"
    if _CONTROL.search(name):
        return f"with control characters in the {key}"
    return None


def _is_int64(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and INT64[0] <= value <= INT64[1])
