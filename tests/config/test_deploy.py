"""The systemd unit nvpair ships, and `nvpair unit`, which prints it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvpair.config.deploy import unit_template, unit_text


def _keys(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith("#"))


def test_the_shipped_unit_contains_nvpair_s_containment() -> None:
    keys = _keys(unit_template())
    assert keys["ExecStart"] == "/usr/local/bin/nvpair serve --config /etc/nvpair/nvpair.toml"
    assert keys["KillMode"] == "mixed"  # SIGTERM to nvpair; SIGKILL to the whole cgroup
    assert keys["Delegate"] == "yes"
    assert keys["StateDirectory"] == "nvpair"
    assert keys["Restart"] == "on-failure"
    assert keys["OOMPolicy"] == "continue"  # an engine's OOM kill is not the unit's end
    assert keys["User"] == "nvpair"
    assert keys["ExecReload"] == "/bin/kill -HUP $MAINPID"  # systemctl reload: a reload
    # nvpair's own shutdown (5 s drain, then the longest built-in grace, 30 s) fits
    assert int(keys["TimeoutStopSec"]) >= 5 + 30


def test_unit_text_names_this_nvpair_its_config_and_user(tmp_path: Path) -> None:
    keys = _keys(unit_text(executable="/opt/nv/bin/nvpair", config=str(tmp_path / "n.toml"),
                           user="gpu"))
    assert keys["ExecStart"] == f"/opt/nv/bin/nvpair serve --config {tmp_path / 'n.toml'}"
    assert keys["User"] == "gpu"


@pytest.mark.parametrize(("args", "says"), [
    (["--user", "9lives"], "nvpair: error: --user: '9lives' is not a user name"),
    (["--user", "a b"], "nvpair: error: --user: 'a b' is not a user name"),
    (["--config", "/etc/my nvpair.toml"], "nvpair: error: --config: '/etc/my nvpair.toml' has"),
    (["--config", "/etc/%h.toml"], "nvpair: error: --config: '/etc/%h.toml' has"),
])
def test_nvpair_unit_refuses_what_a_unit_would_misread(args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "nvpair", "unit", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(says) and r.stderr.count("\n") == 1


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_accepts_the_printed_unit(tmp_path: Path) -> None:
    unit = tmp_path / "nvpair.service"
    r = subprocess.run([sys.executable, "-m", "nvpair", "unit", "--config",
                        str(tmp_path / "nvpair.toml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    # ExecStart must name an executable that exists for verify to pass
    unit.write_text(r.stdout.replace(_keys(r.stdout)["ExecStart"].split()[0], sys.executable))
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert v.returncode == 0 and v.stdout + v.stderr == "", v.stdout + v.stderr


def test_the_keep_unit_leaves_engines_to_a_restart_and_stops_them_on_a_stop() -> None:
    keys = _keys(unit_text(executable="/opt/nv/bin/nvpair", config="/etc/n.toml",
                           on_exit="keep"))
    assert keys["KillMode"] == "process"  # nothing but nvpair is signalled by systemd
    assert keys["ExecStop"] == ("/opt/nv/bin/nvpair stop-engines --config /etc/n.toml "
                                "--systemd-unit %n")
    assert keys["ExecStart"] == "/opt/nv/bin/nvpair serve --config /etc/n.toml"
    assert keys["Restart"] == "on-failure" and keys["OOMPolicy"] == "continue"
    assert "ExecStop" not in _keys(unit_text())  # the default: stop, as before


def test_nvpair_unit_follows_the_config_s_on_exit(tmp_path: Path) -> None:
    config = tmp_path / "nvpair.toml"
    config.write_text("on_exit = 'keep'\n[[engines]]\nname = 'e'\nkind = 'vllm'\n"
                      "model = 'm'\nmanaged = true\ncommand = ['x']\n")
    r = subprocess.run([sys.executable, "-m", "nvpair", "unit", "--config", str(config)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _keys(r.stdout)["KillMode"] == "process"
    r = subprocess.run([sys.executable, "-m", "nvpair", "unit", "--config", str(config),
                        "--on-exit", "stop"], capture_output=True, text=True, timeout=60)
    assert _keys(r.stdout)["KillMode"] == "mixed"


def test_nvpair_unit_keeps_a_groups_rank_but_not_its_head(tmp_path: Path) -> None:
    """A rank's process is kept (docs/groups.md); the head's stops with nvpair, so a node
    that is only a group's head gets the default unit."""
    (tmp_path / "token").write_text("secret\n")
    for node, kill_mode in (("n1", "process"), ("n0", "mixed")):
        config = tmp_path / f"{node}.toml"
        config.write_text(
            f"on_exit = 'keep'\nnode = '{node}'\n[[engines]]\nname = 'g'\nkind = 'sglang'\n"
            "model = 'm'\nmanaged = true\n[engines.group]\nranks = ['n0', 'n1']\n"
            "dist_port = 50000\n[[peers]]\nurl = 'http://127.0.0.1:1'\n[cluster]\n"
            "token_file = 'token'\n")
        r = subprocess.run([sys.executable, "-m", "nvpair", "unit", "--config", str(config)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert _keys(r.stdout)["KillMode"] == kill_mode, (node, r.stdout)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_accepts_the_keep_unit(tmp_path: Path) -> None:
    unit = tmp_path / "nvpair.service"
    text = unit_text(executable=sys.executable, config=str(tmp_path / "nvpair.toml"),
                     on_exit="keep")
    unit.write_text(text)
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert v.returncode == 0 and v.stdout + v.stderr == "", v.stdout + v.stderr
