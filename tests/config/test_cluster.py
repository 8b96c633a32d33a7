"""The [cluster] table: what enables peers, defaults, and one-line errors."""

from __future__ import annotations

import re

import pytest

from nvpair.config.settings import load_settings
from nvpair.errors import ConfigError

PEER = "[[peers]]\nurl = 'http://10.0.0.2:14322/'\nname = 'b'\n"


@pytest.fixture
def load(write):
    write("cluster", "cluster-secret\n")
    write("user", "user-secret\n")
    write("peer-b", "b-secret\n")
    write("etcd-pw", "pw\n")

    def _load(text: str):
        return load_settings(str(write("nvpair.toml", "node = 'a'\n" + text)))

    return _load


def error(load, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(text)
    return str(info.value)


def test_peers_are_off_without_peers_token_or_etcd(load) -> None:
    assert load("").cluster is None
    assert load("[cluster]\ninterval_s = 2\n").cluster is None


def test_push_defaults_and_per_peer_tokens(load) -> None:
    c = load(PEER + "[[peers]]\nurl = 'http://10.0.0.3:1'\ntoken_file = 'peer-b'\n"
             "[cluster]\ntoken_file = 'cluster'\n").cluster
    assert c is not None and c.backend == "push" and c.token == "cluster-secret"
    assert (c.interval_s, c.ttl_s, c.push_timeout_s) == (5.0, 15.0, 2.0)
    assert [(p.url, p.name, p.token) for p in c.peers] == [
        ("http://10.0.0.2:14322", "b", "cluster-secret"), ("http://10.0.0.3:1", None, "b-secret")]
    only_receives = load("[cluster]\ntoken_file = 'cluster'\n").cluster
    assert only_receives is not None and only_receives.peers == ()


def test_etcd_defaults(load) -> None:
    c = load("[cluster]\nbackend = 'etcd'\netcd_url = 'http://127.0.0.1:2379'\n"
             "etcd_username = 'nv'\netcd_password_file = 'etcd-pw'\n").cluster
    assert c is not None and c.etcd is not None and c.token is None
    assert (c.etcd.lease_ttl_s, c.etcd.debounce_s, c.etcd.prefix) == (10, 5.0,
                                                                     "nvpair/default/nodes/")
    assert (c.etcd.username, c.etcd.password) == ("nv", "pw")
    c = load("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_lease_ttl_s = 4\n")
    assert c.cluster is not None and c.cluster.etcd is not None
    assert c.cluster.etcd.debounce_s == 2.0


@pytest.mark.parametrize(("text", "expected"), [
    (PEER, r"cluster.token_file: required when \[\[peers\]\] are configured"),
    ("token_file = 'user'\n" + PEER + "[cluster]\ntoken_file = 'user'\n",
     "cluster.token_file: must differ from token_file"),
    (PEER + "[cluster]\ntoken_file = 'missing'\n", "cluster.token_file: cannot read"),
    (PEER + "[cluster]\ntoken_file = 'cluster'\ninterval_s = 5\nttl_s = 6\n",
     r"cluster.ttl_s: must be at least 2 x interval_s \(10 s\)"),
    (PEER + "[cluster]\ntoken_file = 'cluster'\nadvertise_url = 'me:1'\n",
     "cluster.advertise_url: expected http"),
    ("[cluster]\ntoken_file = 'cluster'\nbackend = 'gossip'\n",
     "cluster.backend: invalid enum value 'gossip'"),
    ("[cluster]\nbackend = 'etcd'\n", "cluster.etcd_url: required when backend = 'etcd'"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'etcd:2379'\n", "cluster.etcd_url: expected"),
    (PEER + "[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\n",
     "peers: not used with cluster.backend = 'etcd'"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_username = 'x'\n",
     "set both etcd_username and etcd_password_file"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_ca_file = 'cluster'\n",
     "TLS files are set, so use https://"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'https://e:1'\netcd_ca_file = 'cluster'\n",
     r"cluster.etcd_ca_file: not a PEM certificate file \("),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_lease_ttl_s = 1\n",
     "cluster.etcd_lease_ttl_s: expected"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_prefix = 'x'\n",
     "cluster.etcd_prefix: must end with '/'"),
    ("[cluster]\ntoken_file = 'cluster'\nintervall_s = 1\n", "cluster.intervall_s: unknown key"),
    (PEER + "[cluster]\ntoken_file = 'cluster'\ninterval_s = 5\nttl_s = 360\n",
     r"cluster.ttl_s: at most 300 s \(peers cap it there\), got 360 s$"),
    (PEER + "[cluster]\ntoken_file = 'cluster'\ninterval_s = 200\n",
     r"cluster.ttl_s: must be at least 2 x interval_s \(400 s\).*; it is 300 s unless set$"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://e:1'\netcd_lease_ttl_s = 600\n",
     "cluster.etcd_lease_ttl_s: expected"),
    ("[[peers]]\nurl = 'file:///etc/passwd'\n",
     r"peers\[0\].url: expected http\(s\)://HOST:PORT, got 'file:///etc/passwd'"),
    ("[cluster]\ntoken_file = 'cluster'\n[[peers]]\nurl = 'http://b:1'\ntoken_file = 'nope'\n",
     r"peers\[0\].token_file: cannot read"),
    # URLs nothing could use are config errors (they were accepted, then failed at use)
    ("[[peers]]\nurl = 'http://b:99999'\n",
     r"peers\[0\].url: not a valid URL \(Port out of range 0-65535\), got 'http://b:99999'"),
    ("[[peers]]\nurl = 'http://[::1'\n", r"peers\[0\].url: not a valid URL \(Invalid IPv6"),
    (PEER + "[cluster]\ntoken_file = 'cluster'\nadvertise_url = 'http://me:0'\n",
     r"cluster.advertise_url: port 0 is not in 1-65535"),
    ("[cluster]\nbackend = 'etcd'\netcd_url = 'http://[zz]:2379'\n",
     r"cluster.etcd_url: .*zz"),
])
def test_errors_are_one_line_and_name_the_key(load, text: str, expected: str) -> None:
    message = error(load, text)
    assert "\n" not in message
    assert re.search(expected, message), message


def test_a_node_name_must_suit_a_key(load, write) -> None:
    path = write("bad.toml", "node = 'a b'\n[cluster]\ntoken_file = 'cluster'\n")
    with pytest.raises(ConfigError, match="node: 'a b' cannot name a peer"):
        load_settings(str(path))


def test_a_long_interval_gets_the_longest_ttl_by_default(load) -> None:
    c = load(PEER + "[cluster]\ntoken_file = 'cluster'\ninterval_s = 120\n").cluster
    assert (c.interval_s, c.ttl_s) == (120.0, 300.0)  # 3 x 120 is past the receivers' cap

