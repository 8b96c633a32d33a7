"""The ``[cluster]`` table of nvpair.toml, and what it resolves to (part of the config:
pure and sync; the peers package reads the resolved settings, this module imports no peers).

Peers are enabled by ``[[peers]]`` (push), by ``cluster.backend = "etcd"``, or by a cluster
token alone (a node that only receives adverts). The push backend needs the cluster token:
peers present it on every advert, and it must differ from the API's ``token_file``.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Literal, Protocol

import msgspec

from nvpair.base.urls import url_problem
from nvpair.config.manifest import Base, Seconds
from nvpair.errors import ConfigError

Backend = Literal["push", "etcd"]
#: receivers hold any peer to 1-300 s (table.TTL_RANGE): no advert can pin itself longer
MAX_TTL_S = 300
LeaseTTL = Annotated[int, msgspec.Meta(ge=2, le=MAX_TTL_S)]
NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ClusterConfig(Base, frozen=True):
    #: a shared secret peers present on adverts; required with [[peers]]; not the API token.
    token_file: str | None = None
    #: how peers reach this node (default: the listen address; the host name for 0.0.0.0).
    advertise_url: str | None = None
    backend: Backend = "push"
    #: push: an advert goes to every peer at least this often (x0.8-1.2), and at once on change.
    interval_s: Seconds = 5.0
    #: push: a peer is stale after this long without an advert, gone after twice it
    #: (default 3 x interval_s).
    ttl_s: Seconds | None = None
    #: push: one advert request may take this long (connect included).
    push_timeout_s: Seconds = 2.0
    etcd_url: str | None = None
    #: every node's advert lives under this prefix (one key per node).
    etcd_prefix: str = "nvpair/default/nodes/"
    etcd_lease_ttl_s: LeaseTTL = 10
    #: a deleted key is shown stale this long before it is dropped (default min(5, TTL/2)).
    etcd_debounce_s: Seconds | None = None
    etcd_username: str | None = None
    etcd_password_file: str | None = None
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None


class PeerTarget(msgspec.Struct, frozen=True):
    """One configured peer: where adverts go and the token they carry."""

    url: str
    token: str
    name: str | None = None


class EtcdSettings(msgspec.Struct, frozen=True):
    url: str
    prefix: str
    lease_ttl_s: int
    debounce_s: float
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class ClusterSettings(msgspec.Struct, frozen=True):
    backend: Backend
    #: the token adverts to this node must carry (None only with etcd).
    token: str | None
    advertise_url: str | None
    interval_s: float
    ttl_s: float
    push_timeout_s: float
    peers: tuple[PeerTarget, ...] = ()
    etcd: EtcdSettings | None = None


class _Peer(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def token_file(self) -> str | None: ...
    @property
    def name(self) -> str | None: ...


SecretReader = Callable[[str, str, str, Path], str]


def resolve_cluster(c: ClusterConfig, peers: Sequence[_Peer], *, source: str, base: Path,
                    node: str, api_token: str | None,
                    read_secret: SecretReader) -> ClusterSettings | None:
    """Check the ``[cluster]`` table against ``[[peers]]``; None when peers are not enabled."""
    where = f"{source}: cluster"
    peer_tokens: list[str | None] = []
    for i, peer in enumerate(peers):
        if (problem := url_problem(peer.url)) is not None:
            raise ConfigError(f"{source}: peers[{i}].url: {problem}, got {peer.url!r}")
        peer_tokens.append(None if not peer.token_file else read_secret(
            peer.token_file, source, f"peers[{i}].token_file", base))
    if c.backend == "push" and not peers and c.token_file is None:
        return None
    if not re.match(NODE_PATTERN, node):
        raise ConfigError(f"{source}: node: {node!r} cannot name a peer; use letters, digits, "
                          "'.', '-' and '_' (set node in the config)")
    if c.backend == "etcd" and peers:
        raise ConfigError(f"{source}: peers: not used with cluster.backend = 'etcd' (nodes "
                          "find each other in etcd); remove [[peers]]")
    token = None
    if c.token_file is not None:
        token = read_secret(c.token_file, source, "cluster.token_file", base)
        if token == api_token:
            raise ConfigError(f"{where}.token_file: must differ from token_file (the cluster "
                              "token is for nodes, the API token for users)")
    elif c.backend == "push":
        raise ConfigError(f"{where}.token_file: required when [[peers]] are configured (a "
                          "shared secret that adverts between nodes carry)")
    if c.advertise_url is not None and (problem := url_problem(c.advertise_url)) is not None:
        raise ConfigError(f"{where}.advertise_url: {problem}, got {c.advertise_url!r}")
    interval, ttl = c.interval_s, c.ttl_s or min(3 * c.interval_s, MAX_TTL_S)
    if ttl < 2 * interval:
        raise ConfigError(f"{where}.ttl_s: must be at least 2 x interval_s ({2 * interval:g} s) "
                          "so that one late advert does not make a peer stale"
                          + ("" if c.ttl_s else f"; it is {ttl:g} s unless set"))
    if ttl > MAX_TTL_S:
        raise ConfigError(f"{where}.ttl_s: at most {MAX_TTL_S} s (peers cap it there), got "
                          f"{ttl:g} s")
    targets = []
    for peer, own in zip(peers, peer_tokens, strict=True):
        peer_token = own or token
        assert peer_token is not None  # push always has the cluster token
        targets.append(PeerTarget(url=peer.url.rstrip("/"), token=peer_token, name=peer.name))
    etcd = None
    if c.backend == "etcd":
        etcd = _resolve_etcd(c, where, source, base, read_secret)
    return ClusterSettings(backend=c.backend, token=token, advertise_url=c.advertise_url,
                           interval_s=interval, ttl_s=ttl, push_timeout_s=c.push_timeout_s,
                           peers=tuple(targets), etcd=etcd)


def _resolve_etcd(c: ClusterConfig, where: str, source: str, base: Path,
                  read_secret: SecretReader) -> EtcdSettings:
    if c.etcd_url is None:
        raise ConfigError(f"{where}.etcd_url: required when backend = 'etcd'")
    if (problem := url_problem(c.etcd_url)) is not None:
        raise ConfigError(f"{where}.etcd_url: {problem}, got {c.etcd_url!r}")
    if not c.etcd_prefix.endswith("/"):
        raise ConfigError(f"{where}.etcd_prefix: must end with '/', got {c.etcd_prefix!r}")
    if (c.etcd_username is None) != (c.etcd_password_file is None):
        raise ConfigError(f"{where}: set both etcd_username and etcd_password_file, or neither")
    password = None
    if c.etcd_password_file is not None:
        password = read_secret(c.etcd_password_file, source, "cluster.etcd_password_file", base)
    files = {}
    for key in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
        value = getattr(c, key)
        if value is not None:
            path = Path(value).expanduser()
            path = path if path.is_absolute() else base / path
            if not path.is_file():
                raise ConfigError(f"{where}.{key}: no such file {path}")
            files[key] = str(path)
    if files and not c.etcd_url.startswith("https://"):
        raise ConfigError(f"{where}.etcd_url: TLS files are set, so use https://")
    if ("etcd_cert_file" in files) != ("etcd_key_file" in files):
        raise ConfigError(f"{where}: set both etcd_cert_file and etcd_key_file, or neither")
    _check_tls(files, where)
    ttl = c.etcd_lease_ttl_s
    return EtcdSettings(url=c.etcd_url.rstrip("/"), prefix=c.etcd_prefix, lease_ttl_s=ttl,
                        debounce_s=c.etcd_debounce_s or min(5.0, ttl / 2),
                        username=c.etcd_username, password=password,
                        ca_file=files.get("etcd_ca_file"), cert_file=files.get("etcd_cert_file"),
                        key_file=files.get("etcd_key_file"))


def _check_tls(files: dict[str, str], where: str) -> None:
    """Load the TLS files as the etcd client will, so a bad one is a config error."""
    if not files:
        return
    try:
        context = ssl.create_default_context(cafile=files.get("etcd_ca_file"))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{where}.etcd_ca_file: not a PEM certificate file ({exc})") from None
    if "etcd_cert_file" in files:
        try:
            context.load_cert_chain(files["etcd_cert_file"], files["etcd_key_file"])
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"{where}.etcd_cert_file/etcd_key_file: not a PEM certificate "
                              f"and its key ({exc})") from None
