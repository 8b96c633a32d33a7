import pytest

from nvpair.config.command import CommandError, build_command, engine_env, key_in_argv
from nvpair.config.manifest import load_manifest


def test_placeholders_fill_whole_arguments_never_split() -> None:
    argv, _ = build_command(load_manifest("llamacpp"), None, {
        "model": "/models/a b; rm -rf / $(x).gguf", "host": "127.0.0.1", "port": 8080})
    assert argv[:3] == ["llama-server", "-m", "/models/a b; rm -rf / $(x).gguf"]
    assert argv[3:] == ["--host", "127.0.0.1", "--port", "8080"]


def test_optional_fragments_only_with_values() -> None:
    m = load_manifest("sglang")
    values = {"model": "m", "host": "h", "port": 1, "tp": 4}
    argv, _ = build_command(m, None, values)
    assert "--api-key" not in argv and "--nnodes" not in argv
    assert argv[-2:] == ["--tp-size", "4"]
    argv, _ = build_command(m, None, {**values, "api_key": "k", "served_name": "s"})
    assert argv[-4:] == ["--served-model-name", "s", "--api-key", "k"]


def test_env_placeholders() -> None:
    argv, env = build_command(load_manifest("ollama"), None, {"host": "127.0.0.1", "port": 1})
    assert argv == ["ollama", "serve"] and env == {"OLLAMA_HOST": "127.0.0.1:1"}


def test_missing_required_placeholder_names_it() -> None:
    with pytest.raises(CommandError, match=r"needs a value for \{model\}"):
        build_command(load_manifest("vllm"), None, {"host": "h", "port": 1, "tp": 1})


def test_config_command_overrides_template() -> None:
    argv, _ = build_command(load_manifest("openai"), ("srv", "--port={port}"), {"port": 9})
    assert argv == ["srv", "--port=9"]


def test_engines_never_inherit_nvpairs_secrets() -> None:
    inherited = {"PATH": "/bin", "NVPAIR_TOKEN": "user-secret", "HOME": "/root"}
    env = engine_env(inherited, {"OLLAMA_HOST": "h:1"}, {"HOME": "/srv"})
    assert env == {"PATH": "/bin", "HOME": "/srv", "OLLAMA_HOST": "h:1"}
    # ... unless the engine's own env in the config gives it one on purpose
    assert engine_env(inherited, {}, {"NVPAIR_TOKEN": "x"})["NVPAIR_TOKEN"] == "x"


def test_keys_reach_llama_server_by_file_and_vllm_by_environment() -> None:
    values = {"model": "m", "host": "h", "port": 1, "tp": 1, "api_key": "k",
              "api_key_file": "/etc/k"}
    argv, env = build_command(load_manifest("llamacpp"), None, values)
    assert argv[-2:] == ["--api-key-file", "/etc/k"] and "k" not in argv and env == {}
    argv, env = build_command(load_manifest("vllm"), None, values)
    assert env == {"VLLM_API_KEY": "k"} and "k" not in argv and "/etc/k" not in argv
    # no key: no variable (optional_env), and nothing else changes
    del values["api_key"], values["api_key_file"]
    assert build_command(load_manifest("vllm"), None, values) == (argv, {})


def test_which_templates_put_the_key_in_argv() -> None:
    assert key_in_argv(load_manifest("sglang"), None)  # its only surface
    assert not key_in_argv(load_manifest("llamacpp"), None)
    assert not key_in_argv(load_manifest("vllm"), None)
    assert key_in_argv(load_manifest("llamacpp"), ("srv", "--key={api_key}"))
    assert not key_in_argv(load_manifest("sglang"), ("srv", "--port", "{port}"))


def test_a_models_dir_starts_llama_server_as_a_router() -> None:
    """llama-server without -m: ``models_dir`` (or ``models_preset``) and ``models_max``
    under [engines.args] pick the manifest's router_start (docs/multi-model.md)."""
    m = load_manifest("llamacpp")
    base = {"host": "127.0.0.1", "port": 8080}
    argv, _ = build_command(m, None, {**base, "models_dir": "/srv/models", "models_max": 2,
                                      "ctx": 2048})
    assert argv == ["llama-server", "--host", "127.0.0.1", "--port", "8080",
                    "--models-dir", "/srv/models", "--models-max", "2", "-c", "2048"]
    argv, _ = build_command(m, None, {**base, "models_preset": "/srv/p.ini"})
    assert argv[-2:] == ["--models-preset", "/srv/p.ini"] and "-m" not in argv
    # without either, a single-model server, whose model is required
    with pytest.raises(CommandError, match=r"start\.argv needs a value for \{model\}"):
        build_command(m, None, {**base, "models_max": 2})
