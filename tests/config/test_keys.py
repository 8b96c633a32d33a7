"""``[[keys]]`` and ``token_file`` in the config: what they resolve to, and their errors in
one line each."""

import logging
import re
from pathlib import Path

import pytest

from nvpair.config.settings import load_settings
from nvpair.errors import InputError


def secret(write, name: str, token: str, mode: int = 0o600) -> Path:
    path = write(name, token + "\n")
    path.chmod(mode)
    return path


def test_keys_resolve_with_their_roles_and_limits_and_token_file_is_an_admin(write) -> None:
    secret(write, "admin", "t-admin")
    secret(write, "batch", "t-batch")
    path = write("nvpair.toml", """
token_file = "admin"
[[keys]]
name = "batch"
token_file = "batch"
role = "user"
priority = -1
max_in_flight = 2
requests_per_minute = 600
models = ["qwen*", "gemma3-270m"]
""")
    s = load_settings(str(path))
    assert [(k.name, k.role) for k in s.keys] == [("token_file", "admin"), ("batch", "user")]
    batch = s.keys[1]
    assert (batch.priority, batch.max_in_flight, batch.requests_per_minute, batch.models) == (
        -1, 2, 600, ("qwen*", "gemma3-270m"))
    assert batch.token == "t-batch" and batch.path == str(path.parent / "batch")
    assert s.token == "t-admin"  # (what the CLI's client sends)
    assert "t-batch" not in repr(s.keys) and "t-batch" not in repr(batch)


def test_keys_alone_allow_a_non_loopback_listen(write) -> None:
    secret(write, "r", "t-r")
    s = load_settings(str(write("nvpair.toml", "listen = '0.0.0.0:1'\n[[keys]]\nname = 'r'\n"
                                               "token_file = 'r'\nrole = 'reader'\n")))
    assert s.token is None and [k.role for k in s.keys] == ["reader"]


@pytest.mark.parametrize(("keys", "expected"), [
    ("[[keys]]\nname = 'a'\ntoken_file = 'ta'\n[[keys]]\nname = 'a'\ntoken_file = 'tb'\n",
     r"nvpair.toml: keys\[1\].name: duplicate key name 'a' \(also keys\[0\]\)$"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'ta'\n[[keys]]\nname = 'b'\ntoken_file = 'same'\n",
     r"keys\[1\].token_file: .*same holds the same token as keys\[0\]: each key needs its "
     r"own token$"),
    ("token_file = 'ta'\n[[keys]]\nname = 'b'\ntoken_file = 'same'\n",
     r"keys\[0\].token_file: .* holds the same token as token_file"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'ta'\nrole = 'root'\n",
     r"keys\[0\].role: invalid enum value 'root' \(expected 'admin', 'reader', 'user'\)$"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'nosuch'\n",
     r"nvpair.toml: keys\[0\].token_file: cannot read .*nosuch: No such file or directory$"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'empty'\n", r"keys\[0\].token_file: .*empty is empty$"),
    ("[[keys]]\nname = 'a b'\ntoken_file = 'ta'\n", r"keys\[0\].name"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'ta'\nmax_in_flight = 0\n", r"keys\[0\].max_in_flight"),
    ("[[keys]]\nname = 'a'\ntoken_file = 'ta'\nmodels = ['']\n", r"keys\[0\].models"),
    ("[[keys]]\nname = 'token_file'\ntoken_file = 'tb'\ntoken_file2 = 1\n", r"token_file2"),
    ("token_file = 'ta'\n[[keys]]\nname = 'token_file'\ntoken_file = 'tb'\n",
     r"keys\[0\].name: duplicate key name 'token_file' \(also token_file\)"),
])
def test_a_bad_key_is_one_line(write, keys: str, expected: str) -> None:
    secret(write, "ta", "token-a")
    secret(write, "tb", "token-b")
    secret(write, "same", "token-a")
    write("empty", "\n")
    with pytest.raises(InputError) as info:
        load_settings(str(write("nvpair.toml", keys)))
    message = str(info.value)
    assert "\n" not in message and "token-a" not in message
    assert re.search(expected, message), message


def test_the_cluster_token_differs_from_every_key(write) -> None:
    secret(write, "ta", "token-a")
    secret(write, "c", "token-a")
    with pytest.raises(InputError, match=r"cluster.token_file: must differ from every key's "
                                         r"token \(it is key 'a''s\)"):
        load_settings(str(write("nvpair.toml", "[[keys]]\nname = 'a'\ntoken_file = 'ta'\n"
                                               "[cluster]\ntoken_file = 'c'\n")))


def test_a_key_file_others_may_read_is_a_warning(write, caplog) -> None:
    secret(write, "open", "token-o", mode=0o644)
    secret(write, "closed", "token-c")
    with caplog.at_level(logging.WARNING, "nvpair.config"):
        s = load_settings(str(write("nvpair.toml",
                                    "[[keys]]\nname = 'o'\ntoken_file = 'open'\n"
                                    "[[keys]]\nname = 'c'\ntoken_file = 'closed'\n")))
    assert [k.name for k in s.keys] == ["o", "c"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert re.search(r"keys\[0\].token_file: .*open may be read by other users than its "
                     r"owner: chmod 600 it", warned[0]) and "token-o" not in warned[0]
