import json
from pathlib import Path

import pytest

from nvpair.config.manifest import BUILTIN_KINDS, builtin_dir, decode_manifest, load_manifest
from nvpair.errors import ManifestError


@pytest.mark.parametrize("kind", BUILTIN_KINDS)
def test_builtin_manifests_load(kind: str) -> None:
    m = load_manifest(kind)
    assert m.kind == kind
    assert m.probes.ready.path.startswith("/")


@pytest.mark.parametrize("kind", BUILTIN_KINDS)
def test_no_builtin_manifest_generates_by_default(kind: str) -> None:
    m = load_manifest(kind)
    assert not m.allow_generating_probes
    for probe in (m.probes.ready, m.probes.health, m.probes.identity, m.probes.models):
        assert probe is None or probe.cost != "generating"


def test_sglang_never_probes_health_or_server_info() -> None:
    m = load_manifest("sglang")
    paths = {p.path for p in (m.probes.ready, m.probes.health, m.probes.identity, m.probes.models)
             if p}
    assert not paths & {"/health", "/health_generate", "/server_info", "/get_server_info"}


def base_manifest() -> dict:
    return json.loads((builtin_dir() / "vllm.json").read_text())


def decode(doc: object) -> None:
    decode_manifest(json.dumps(doc).encode(), "x.json")


def test_generating_probe_without_opt_in_is_rejected() -> None:
    doc = base_manifest()
    doc["probes"]["health"].update(cost="generating", interval_s=60, timeout_s=25)
    with pytest.raises(ManifestError, match=r"^x.json: probes.health: cost 'generating'.*"
                       "allow_generating_probes"):
        decode(doc)


def test_generating_probe_with_opt_in_loads_at_a_low_rate_only() -> None:
    doc = base_manifest()
    doc["allow_generating_probes"] = True
    doc["probes"]["health"].update(cost="generating", interval_s=60, timeout_s=25)
    decode(doc)
    doc["probes"]["health"].update(interval_s=5, timeout_s=5)
    with pytest.raises(ManifestError, match=r"probes.health: a generating probe needs interval_s"):
        decode(doc)


def test_unknown_key_names_the_path() -> None:
    doc = base_manifest()
    doc["probes"]["health"]["timout_s"] = 3
    with pytest.raises(ManifestError) as info:
        decode(doc)
    assert str(info.value) == "x.json: probes.health.timout_s: unknown key (check the spelling)"


def test_wrong_type_names_the_path() -> None:
    doc = base_manifest()
    doc["default_port"] = "8000"
    with pytest.raises(ManifestError) as info:
        decode(doc)
    assert str(info.value) == "x.json: default_port: expected int, got str"


def test_not_json_gives_line_and_column() -> None:
    with pytest.raises(ManifestError, match=r"^x.json: not valid JSON: .* line 2, column"):
        decode_manifest(b'{"kind": "x",\n  oops}', "x.json")


def test_timeout_longer_than_interval_is_rejected() -> None:
    doc = base_manifest()
    doc["probes"]["health"].update(interval_s=1, timeout_s=5)
    with pytest.raises(ManifestError,
                       match=r"probes\.health: timeout_s must not exceed interval_s"):
        decode(doc)


def test_unknown_kind() -> None:
    with pytest.raises(ManifestError, match="unknown engine kind 'sglangg'"):
        load_manifest("sglangg")


def test_missing_manifest_path(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read manifest: No such file"):
        load_manifest(str(tmp_path / "nope.json"))


def test_a_restart_backoff_that_starts_above_its_maximum_is_rejected() -> None:
    doc = base_manifest()
    doc["restart"] = {"initial_s": 90, "max_s": 60}
    with pytest.raises(ManifestError) as info:
        decode(doc)
    assert str(info.value) == "x.json: restart.initial_s (90) is above restart.max_s (60)"


@pytest.mark.parametrize("key, value", [("port_open_while_loading", True),
                                        ("deprecated_paths", ["/get_model_info"])])
def test_a_removed_key_says_it_is_no_longer_read(key: str, value: object) -> None:
    """Keys earlier manifests had (and nvpair never read) are refused in one line that says
    so, rather than as an unknown key."""
    doc = json.loads((builtin_dir() / "vllm.json").read_text())
    doc[key] = value
    with pytest.raises(ManifestError) as info:
        decode_manifest(json.dumps(doc).encode(), "m.json")
    assert str(info.value).startswith(f"m.json: {key}: no longer a manifest key (")
    assert "\n" not in str(info.value)


def test_notes_are_for_people_and_in_the_schema() -> None:
    manifest = load_manifest("sglang")
    assert "deprecated names" in manifest.notes
    from nvpair.config.schema import schema_json
    assert "never reads it" in schema_json("manifest")


def test_a_manifest_is_decoded_once_and_again_when_its_file_changes(tmp_path: Path) -> None:
    # 1,000 engines of one kind share one decoded manifest (it is frozen); an edited file
    # is decoded again, never served from the old bytes.
    assert load_manifest("sglang") is load_manifest("sglang")
    path = tmp_path / "mine.json"
    text = (builtin_dir() / "sglang.json").read_text()
    path.write_text(text)
    first = load_manifest(str(path))
    assert load_manifest(str(path)) is first
    path.write_text(text.replace('"display_name": "', '"display_name": "Edited '))
    edited = load_manifest(str(path))
    assert edited.display_name.startswith("Edited ")
    assert first.display_name == load_manifest("sglang").display_name
