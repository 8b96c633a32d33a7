"""``[[keys]]``: the API's bearer tokens, each with a name, a role and its limits, and the
old ``token_file``, which is one admin key (pure and sync, as the rest of the config; the
tokens are read from their files once here, and again on change by ``nvpair.http.keys``).

Roles, by the kind of route (``nvpair.http.keys.route_kind``): ``admin`` may do everything;
``user`` may list models and route requests; ``reader`` may read status, events, metrics
and history (GET only).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from nvpair.config.manifest import Base
from nvpair.errors import ConfigError

Role = Literal["admin", "user", "reader"]
KeyName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
#: the name of the key the top-level ``token_file`` makes (an admin)
TOKEN_FILE_KEY = "token_file"

log = logging.getLogger("nvpair.config")


class KeyConfig(Base, frozen=True):
    """One ``[[keys]]`` table."""

    name: KeyName
    #: the token, alone in the file (0600); read again when the file changes
    token_file: str
    role: Role = "user"
    #: higher is served first when requests wait (the queues' order; default 0)
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    #: routed requests of this key at once (default: no limit)
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None
    #: routed requests a minute, a token bucket of this size (default: no limit)
    requests_per_minute: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] | None = None
    #: glob patterns of the model ids this key may see and use (default: every model)
    models: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...] | None = None


class KeySpec(msgspec.Struct, frozen=True):
    """A resolved key: its file made absolute, and its token as read at start."""

    name: str
    path: str
    role: str
    token: str = ""
    priority: int = 0
    max_in_flight: int | None = None
    requests_per_minute: int | None = None
    models: tuple[str, ...] | None = None

    def __repr__(self) -> str:  # never a token in a traceback or a log line
        return f"KeySpec(name={self.name!r}, role={self.role!r})"


def token_digest(token: bytes) -> bytes:
    """What tokens are compared by: equal lengths, so a comparison tells nothing of the
    length of the token it was compared with."""
    return hashlib.sha256(token).digest()


def secret_path(path: str, base: Path) -> Path:
    full = Path(path).expanduser()
    return full if full.is_absolute() else base / full


def read_token(path: Path) -> str:
    """The token in ``path``, stripped; OSError or ValueError (empty) with the reason."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def open_to_others(path: Path) -> bool:
    """``path`` may be read by users other than its owner (group or others)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def resolve_keys(keys: tuple[KeyConfig, ...], token_file: str | None, source: str,
                 base: Path) -> tuple[KeySpec, ...]:
    """Every key: the top-level ``token_file`` first (an admin named ``token_file``), then
    ``[[keys]]`` in order. Raises ConfigError, one line, for a duplicate name or token or a
    file that cannot be read; a file others may read is a warning."""
    tables: list[tuple[str, KeyConfig]] = []
    if token_file is not None:
        tables.append(("token_file", KeyConfig(name=TOKEN_FILE_KEY, token_file=token_file,
                                               role="admin")))
    tables += [(f"keys[{i}]", key) for i, key in enumerate(keys)]
    specs: list[KeySpec] = []
    names: dict[str, str] = {}
    digests: dict[bytes, str] = {}
    for where, key in tables:
        field = where if where == "token_file" else f"{where}.token_file"
        if key.name in names:
            raise ConfigError(f"{source}: {where}.name: duplicate key name {key.name!r} "
                              f"(also {names[key.name]})")
        names[key.name] = where
        path = secret_path(key.token_file, base)
        try:
            token = read_token(path)
        except OSError as exc:
            raise ConfigError(f"{source}: {field}: cannot read {path}: {exc.strerror}"
                              ) from None
        except ValueError as exc:
            raise ConfigError(f"{source}: {field}: {exc}") from None
        digest = token_digest(token.encode())
        if digest in digests:
            raise ConfigError(f"{source}: {field}: {path} holds the same token as "
                              f"{digests[digest]}: each key needs its own token")
        digests[digest] = where
        if open_to_others(path):
            log.warning("%s: %s: %s may be read by other users than its owner: "
                        "chmod 600 it", source, field, path)
        specs.append(KeySpec(name=key.name, path=str(path), role=key.role, token=token,
                             priority=key.priority, max_in_flight=key.max_in_flight,
                             requests_per_minute=key.requests_per_minute, models=key.models))
    return tuple(specs)
