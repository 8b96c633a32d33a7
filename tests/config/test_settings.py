from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from nvpair.base.decoding import SIZE_UNITS, parse_size
from nvpair.config.settings import load_settings
from nvpair.errors import ConfigError, InputError

GOOD = """
listen = "127.0.0.1:14322"
node = "spark-1"

[[engines]]
name = "head"
kind = "sglang"
model = "deepseek-ai/DeepSeek-V4.1-Flash"
port = 30000
[engines.args]
tp = 4
[engines.probes.health]
interval_s = 10

[[engines]]
name = "small"
kind = "llamacpp"
managed = true
model = "/models/gemma.gguf"

[[peers]]
url = "http://10.0.0.2:14322"

[cluster]
token_file = "cluster-token"
"""


def settings_for(write, text: str, name: str = "nvpair.toml"):
    return load_settings(str(write(name, text)))


def error_for(write, text: str) -> str:
    with pytest.raises(InputError) as info:
        settings_for(write, text)
    return str(info.value)


def test_good_config_resolves(write) -> None:
    write("cluster-token", "cluster-secret\n")
    s = settings_for(write, GOOD)
    assert (s.listen_host, s.listen_port, s.node) == ("127.0.0.1", 14322, "spark-1")
    head, small = s.engines
    assert head.url == "http://127.0.0.1:30000"
    assert head.probes.health.interval_s == 10
    assert head.probes.health.path == "/ping"  # the manifest's, only the interval overridden
    assert head.args == {"tp": 4}
    assert small.port == 8080 and small.managed
    assert s.cluster is not None and s.cluster.peers[0].url == "http://10.0.0.2:14322"


def test_embedded_default_adopts_builtin_kinds(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NVPAIR_CONFIG", raising=False)
    s = load_settings()
    assert s.source == "(embedded default)"
    assert {e.kind for e in s.engines} == {"sglang", "vllm", "llamacpp", "ollama", "tgi"}
    assert all(e.optional and not e.managed for e in s.engines)


def test_env_var_names_the_config(write, monkeypatch) -> None:
    path = write("elsewhere.toml", 'node = "x"\n')
    monkeypatch.setenv("NVPAIR_CONFIG", str(path))
    assert load_settings().node == "x"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("listen = \n", r"nvpair.toml: not valid TOML: .*line 1"),
        ("x = " + "[" * 3000 + "]" * 3000 + "\n",  # a RecursionError out of tomllib before
         r"nvpair.toml: not valid TOML: arrays or tables nested too deeply$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nprot = 1\n",
         r"nvpair.toml: engines\[0\].prot: unknown key \(check the spelling\)$"),
        ("[[engines]]\nname='a'\nkind='vllm'\n[[engines]]\nname='b'\nkind='vllm'\nport='80'\n",
         r"nvpair.toml: engines\[1\].port: expected int, got str$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nport = 70000\n",
         r"nvpair.toml: engines\[0\].port: expected int <= 65535$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[[engines]]\nname = 'a'\nkind = 'tgi'\n",
         r"nvpair.toml: engines\[1\].name: duplicate engine name 'a'$"),
        ("[[engines]]\nname = 'a'\nkind = 'sglangg'\n",
         r"nvpair.toml: engines\[0\].kind: unknown engine kind 'sglangg' \(built-in: .*\)$"),
        ("[[engines]]\nname = 'a'\nkind = 'missing.json'\n",
         r"nvpair.toml: engines\[0\].kind: .*missing.json: cannot read manifest"),
        ("[[engines]]\nname = 'a'\nkind = 'openai'\nmanaged = true\n",
         r"engines\[0\]: managed = true but neither the engine's command nor"),
        ("listen = '0.0.0.0:14322'\n",
         r"listen: 0.0.0.0 is not a loopback address; set token_file"),
        ("token_file = 'nope'\n", r"nvpair.toml: token_file: cannot read .*nope"),
        ("[[engines]]\nname = 'Bad Name'\nkind = 'vllm'\n",
         r"engines\[0\].name: expected lower-case letters, digits"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.probes.health]\ncost = 'generating'\n"
         "interval_s = 60\ntimeout_s = 20\n",
         r"engines\[0\]: probes.health: cost 'generating' .* allow_generating_probes"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.probes.healthz]\ninterval_s = 1\n",
         r"engines\[0\].probes.healthz: unknown key \(check the spelling\)"),
        ("listen = 'localhost'\n", r"listen: expected HOST:PORT"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nhost = 'http://x'\n",
         r"engines\[0\].host: expected an IP address or a host name, got 'http://x'$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nhost = 'my host'\n", r"engines\[0\].host: "),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nhost = ''\n", r"engines\[0\].host: "),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.probes.health]\nexpect_status = []\n",
         r"engines\[0\].probes.health.expect_status: expected array of length >= 1$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.probes.health]\ninterval_s = 'x'\n",
         r"engines\[0\].probes.health.interval_s: expected float, got str$"),
        ("[[peers]]\nurl = 'ftp://x'\n", r"peers\[0\].url: expected http\(s\)://HOST:PORT"),
        # what the OS cannot take as an environment or argv (the spawn raised ValueError)
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.env]\n'A=B' = 'x'\n",
         r"nvpair.toml: engines\[0\].env: the name 'A=B' contains =; environment variable"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.env]\n\"A\\u0000\" = 'x'\n",
         r"nvpair.toml: engines\[0\].env: the name 'A\\x00' contains a NUL byte"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.env]\n'' = 'x'\n",
         r"nvpair.toml: engines\[0\].env: an environment variable name is empty$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.env]\nA = \"x\\u0000\"\n",
         r"nvpair.toml: engines\[0\].env.A: the value contains a NUL byte$"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\nmodel = \"m\\u0000\"\n",
         r"nvpair.toml: engines\[0\].model: contains a NUL byte"),
        ("[[engines]]\nname = 'a'\nkind = 'openai'\nmanaged = true\n"
         "command = ['srv', \"--x=\\u0000\"]\n",
         r"nvpair.toml: engines\[0\].command\[1\]: contains a NUL byte"),
        ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.args]\ntp = \"4\\u0000\"\n",
         r"nvpair.toml: engines\[0\].args.tp: contains a NUL byte"),
    ],
)
def test_bad_config_gives_one_line(write, text: str, expected: str) -> None:
    message = error_for(write, text)
    assert "\n" not in message
    import re

    assert re.search(expected, message), message


def test_generating_probe_with_opt_in(write) -> None:
    s = settings_for(write, "[[engines]]\nname = 'a'\nkind = 'sglang'\n"
                            "allow_generating_probes = true\n[engines.probes.health]\n"
                            "path = '/health'\ncost = 'generating'\ninterval_s = 60\n"
                            "timeout_s = 25\n")
    assert s.engines[0].probes.health.cost == "generating"
    assert s.engines[0].allow_generating


def test_non_loopback_with_token(write) -> None:
    write("token", "s3cret\n")
    s = settings_for(write, "listen = '0.0.0.0:14322'\ntoken_file = 'token'\n")
    assert s.token == "s3cret"


def test_unreadable_api_key_file(write) -> None:
    msg = error_for(write, "[[engines]]\nname = 'a'\nkind = 'vllm'\n"
                           "api_key_file = '/nonexistent/k'\n")
    assert msg.endswith("nvpair.toml: engines[0]: api_key_file: cannot read /nonexistent/k: "
                        "No such file or directory")


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config: No such file"):
        load_settings(str(tmp_path / "absent.toml"))


def test_two_engines_on_one_port_are_warned_of(write, caplog) -> None:
    settings_for(write, "[[engines]]\nname = 'a'\nkind = 'vllm'\n"
                        "[[engines]]\nname = 'b'\nkind = 'openai'\n")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{write('x', '').parent / 'nvpair.toml'}: engines[1]: 127.0.0.1:8000 is engine 'a' "
        "already: one engine, probed twice"]



# (llama.cpp's key no longer goes in its command: its key file's path does)
@pytest.mark.parametrize("kind", ["sglang", "vllm"])  # in argv; in the environment
def test_a_nul_from_the_api_key_file_in_the_command_is_one_line(write, kind: str) -> None:
    write("key", "se\0cret\n")
    message = error_for(write, f"[[engines]]\nname = 'a'\nkind = '{kind}'\nmanaged = true\n"
                               "model = '/m.gguf'\napi_key_file = 'key'\n")
    assert "\n" not in message
    assert message.endswith("nvpair.toml: engines[0]: the command built for this engine "
                            "contains a NUL byte (from the manifest's start template or "
                            "api_key_file)"), message


def test_the_log_rate_cap_defaults_to_the_pumps_and_is_checked(write) -> None:
    from nvpair.base import logs
    default = settings_for(write, 'listen = "127.0.0.1:14322"\n')
    assert (default.log_lines_per_s, default.log_bytes_per_s) == logs.DEFAULT_RATE
    given = settings_for(write, "log_lines_per_s = 200\nlog_bytes_per_s = 65536\n")
    assert (given.log_lines_per_s, given.log_bytes_per_s) == (200, 65536)
    assert error_for(write, "log_lines_per_s = 0\n").endswith(
        "nvpair.toml: log_lines_per_s: expected int >= 10")


@pytest.mark.parametrize(("text", "expected"), [
    ("[[engines]]\nname = 'a'\nkind = 'vllm'\nmanaged = true\nactivation = 'on-demand'\n",
     "engines[0].activation: invalid enum value 'on-demand' (expected 'always', 'on_demand'; "
     "did you mean 'on_demand'?)"),
    ("[memory]\naction = 'restart'\n",
     "memory.action: invalid enum value 'restart' (expected 'restart_when_quiet', 'warn')"),
    ("[[engines]]\nname = 'a'\nkind = 'vllm'\n[engines.probes.ready]\ncost = 'free'\n",
     "engines[0].probes.ready.cost: invalid enum value 'free' (expected 'cheap', "
     "'generating', 'queued')"),
])
def test_an_enum_error_lists_the_allowed_words(write, text: str, expected: str) -> None:
    message = error_for(write, text)
    assert message.endswith(f"nvpair.toml: {expected}"), message


def test_sizes_take_units(write) -> None:
    s = settings_for(write, "[activation]\nmemory_budget_bytes = '90GB'\n[memory]\n"
                            "reserve_bytes = '2 GiB'\n[[engines]]\nname = 'a'\nkind = 'vllm'\n"
                            "managed = true\nmodel = 'm'\nactivation = 'on_demand'\n"
                            "memory_bytes = '80 MiB'\n[[engines]]\nname = 'b'\nkind = 'vllm'\n"
                            "port = 8001\nmanaged = true\nmodel = 'm'\nmemory_bytes = 1_000\n")
    assert s.activation.memory_budget_bytes == 90 * 10**9
    assert s.memory.reserve_bytes == 2 * 2**30
    assert [e.memory_bytes for e in s.engines] == [80 * 2**20, 1000]
    s = settings_for(write, "[activation]\nmemory_budget_bytes = 'auto'\n")
    assert s.activation.memory_budget_bytes == "auto"


@pytest.mark.parametrize(("where", "text"), [
    ("activation.memory_budget_bytes", "[activation]\nmemory_budget_bytes = '90 GX'\n"),
    ("engines[0].memory_bytes", "[[engines]]\nname = 'a'\nkind = 'vllm'\nmanaged = true\n"
                                "model = 'm'\nmemory_bytes = 'lots'\n"),
    ("memory.reserve_bytes", "[memory]\nreserve_bytes = '0.5 B'\n"),
])
def test_a_size_that_is_not_one_says_what_a_size_is(write, where: str, text: str) -> None:
    message = error_for(write, text)
    assert f"nvpair.toml: {where}: expected a number of bytes, or a size with a unit such as " \
           '"90GB" or "80 MiB" (kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers ' \
           "of 1024), or " in message, message
    assert "enum" not in message


@given(st.integers(0, 10**15), st.sampled_from(sorted(SIZE_UNITS)),
       st.sampled_from(["", " ", "  "]), st.booleans())
def test_a_whole_size_reads_back_exactly(number: int, unit: str, space: str,
                                         upper: bool) -> None:
    text = f"{number}{space}{unit.upper() if upper else unit}"
    assert parse_size(text) == number * SIZE_UNITS[unit]


@given(st.text(max_size=20))
@example("1.5.5GB")
@example("1__0")
@example("")
def test_any_text_is_a_size_or_none_never_an_exception(text: str) -> None:
    value = parse_size(text)
    assert value is None or (isinstance(value, int) and value >= 0)


@given(st.text(alphabet="0123456789_. kKmMgGtTiIbBx", max_size=12))
@example("90GB")
@example("80 MiB")
def test_the_schema_takes_every_size_nvpair_takes(text: str) -> None:
    """An editor that checks the config against `nvpair schema config` never refuses a size
    that nvpair reads."""
    import re

    from nvpair.base.decoding import SIZE_PATTERN
    from nvpair.config.schema import schema

    if parse_size(text) is not None:
        assert re.match(SIZE_PATTERN, text), text
    field = schema("config")["$defs"]["ActivationConfig"]["properties"]["memory_budget_bytes"]
    assert {"type": "string", "pattern": SIZE_PATTERN} in [
        {k: v for k, v in f.items() if k != "description"} for f in field["anyOf"]]


def test_a_key_file_given_to_the_engine_holds_the_key_alone(write) -> None:
    """llama-server reads --api-key-file itself, each line a key as it is: a file whose
    lines are not exactly nvpair's key (stripped) would have the engine refuse nvpair."""
    engine = ("[[engines]]\nname = 'a'\nkind = 'llamacpp'\nmanaged = true\n"
              "model = '/m.gguf'\napi_key_file = 'key'\n")
    for good in ("k1\n", "k1", "k1\n\n"):
        write("key", good)
        assert settings_for(write, engine).engines[0].api_key == "k1"
    for bad in (" k1\n", "k1\r\n", "k1\nk2\n"):
        write("key", bad)
        message = error_for(write, engine)
        assert message.endswith("nvpair.toml: engines[0]: api_key_file: "
                                f"{write('key', bad)} is passed to the engine, which reads "
                                "each line as a key: it must hold the key alone on one line "
                                "(no spaces, no CR)"), message


def test_sleep_needs_a_kind_that_sleeps_and_idle_sleep_needs_sleep(write) -> None:
    """docs/sleep.md: one line naming the key, for a kind whose manifest says nothing of
    sleep, and for idle_sleep_s without sleep = true."""
    message = error_for(write, "[[engines]]\nname = 'a'\nkind = 'ollama'\nsleep = true\n")
    assert message.endswith("engines[0].sleep: the ollama manifest says nothing of how it "
                            "sleeps; remove sleep = true"), message
    message = error_for(write, "[[engines]]\nname = 'a'\nkind = 'llamacpp'\nidle_sleep_s = 5\n")
    assert message.endswith("engines[0].idle_sleep_s: needs sleep = true"), message
    message = error_for(write, "[[engines]]\nname = 'a'\nkind = 'llamacpp'\npin = true\n")
    assert message.endswith("engines[0].pin: only an engine with activation = 'on_demand' "
                            "is ever evicted; remove pin = true"), message


def test_an_engine_that_sleeps_is_probed_on_its_sleeping_probe_and_started_with_its_flags(
        write) -> None:
    s = settings_for(write, "[[engines]]\nname = 'l'\nkind = 'llamacpp'\nmodel = '/m.gguf'\n"
                            "managed = true\nsleep = true\nidle_sleep_s = 300\n"
                            "[[engines]]\nname = 'v'\nkind = 'vllm'\nport = 8001\nmodel = 'm'\n"
                            "managed = true\nsleep = true\nsleep_level = 2\n"
                            "[[engines]]\nname = 'w'\nkind = 'vllm'\nport = 8002\nmodel = 'm'\n"
                            "managed = true\n")
    from nvpair.config.command import build_command
    from nvpair.config.settings import placeholder_values

    llama, vllm, plain = s.engines
    assert (llama.probes.health.path, llama.probes.health.fallback_path) == ("/props", "/health")
    assert llama.probes.health.needs_api_key
    assert (vllm.probes.health.path, plain.probes.health.path) == ("/is_sleeping", "/health")
    argv, env = build_command(llama.manifest, None, placeholder_values(llama))
    assert argv[-2:] == ["--sleep-idle-seconds", "300"] and env == {}
    argv, env = build_command(vllm.manifest, None, placeholder_values(vllm))
    assert "--enable-sleep-mode" in argv and env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert vllm.sleep is not None and vllm.sleep_level == 2
    argv, env = build_command(plain.manifest, None, placeholder_values(plain))
    assert "--enable-sleep-mode" not in argv and "VLLM_SERVER_DEV_MODE" not in env


def test_on_exit_is_the_top_level_s_unless_the_engine_says_otherwise(write) -> None:
    cmd = "command = ['x']\nmanaged = true\nmodel = 'm'\nkind = 'vllm'\n"
    s = load_settings(str(write("nvpair.toml",
        f"on_exit = 'keep'\n[[engines]]\nname = 'a'\nport = 9001\n{cmd}"
        f"[[engines]]\nname = 'b'\nport = 9002\non_exit = 'stop'\n{cmd}"
        "[[engines]]\nname = 'c'\nkind = 'vllm'\nport = 9003\n")))
    assert [e.on_exit for e in s.engines] == ["keep", "stop", "stop"]
    assert [e.on_exit for e in load_settings(str(write("default.toml",
        f"[[engines]]\nname = 'a'\nport = 9001\n{cmd}"))).engines] == ["stop"]  # the default


def test_on_exit_of_an_engine_nvpair_does_not_manage_is_one_line(write) -> None:
    with pytest.raises(ConfigError, match=r"engines\[0\]\.on_exit: needs managed = true"):
        load_settings(str(write("nvpair.toml",
                                "[[engines]]\nname = 'a'\nkind = 'vllm'\non_exit = 'keep'\n")))


@pytest.mark.parametrize(("text", "expected"), [
    ("[tracing]\notlp_endpoint = 'grpc://127.0.0.1:4317'\n",
     r"nvpair.toml: tracing.otlp_endpoint: expected an http:// or https:// URL .* got "
     r"'grpc://127.0.0.1:4317'$"),
    ("[tracing]\notlp_endpoint = 'http://127.0.0.1:99999/v1/traces'\n",
     r"tracing.otlp_endpoint: expected"),
    ("[tracing]\notlp_endpoint = 'http://:4318/v1/traces'\n", r"tracing.otlp_endpoint"),
    ("[tracing]\notlp_endpoint = 'https://user:secret@collector/v1/traces'\n",
     r"tracing.otlp_endpoint: .* got a URL with a user or password \(not shown\)$"),
    ("[tracing]\notlp_endpoint = 'http://c/v1/traces'\nsample_ratio = 1.5\n",
     r"tracing.sample_ratio"),
    ("[tracing]\notlp_endpoint = 'http://c/v1/traces'\nservice_name = ''\n",
     r"tracing.service_name"),
    ("[tracing]\notlp_endpoint = 'http://c/v1/traces'\nheaders_file = 'nope'\n",
     r"tracing.headers_file: cannot read .*nope: No such file"),
    ("[tracing]\nheaders_file = 'h'\n", r"tracing.headers_file: set otlp_endpoint too"),
    ("[tracing]\nendpoint = 'http://c'\n", r"tracing"),
])
def test_a_bad_tracing_table_is_one_line_naming_the_key(write, text: str, expected: str
                                                         ) -> None:
    import re

    message = error_for(write, text)
    assert "\n" not in message
    assert re.search(expected, message), message
    assert "secret" not in message


def test_the_tracing_headers_are_read_and_never_shown(write, tmp_path: Path) -> None:
    (tmp_path / "otlp-headers").write_text(
        "# the collector's token\nAuthorization: Bearer tok-123\n\nX-Scope-OrgID:  team-a\n")
    settings = settings_for(write, "[tracing]\notlp_endpoint = 'http://127.0.0.1:4318/v1/"
                            "traces'\nsample_ratio = 0.25\nheaders_file = 'otlp-headers'\n")
    tracing = settings.tracing
    assert tracing is not None
    assert tracing.headers == (("Authorization", "Bearer tok-123"), ("X-Scope-OrgID", "team-a"))
    assert tracing.sample_ratio == 0.25 and tracing.service_name == "nvpair"
    assert "tok-123" not in repr(tracing) and "tok-123" not in repr(settings)
    (tmp_path / "otlp-headers").write_text("Authorization Bearer tok-123\n")
    message = error_for(write, "[tracing]\notlp_endpoint = 'http://c/'\n"
                        "headers_file = 'otlp-headers'\n")
    assert message.endswith("otlp-headers line 1: expected 'Name: value' (a header name, a "
                            "colon, a value)")
    assert "tok-123" not in message
    assert settings_for(write, "").tracing is None  # (off unless asked for)
