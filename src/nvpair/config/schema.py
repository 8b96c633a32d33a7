"""JSON Schemas of the config and the manifests, generated from the msgspec types."""

from __future__ import annotations

from typing import Any

import msgspec

from nvpair.base.decoding import SIZE_HELP, SIZE_PATTERN
from nvpair.config.manifest import Manifest
from nvpair.config.settings import Config, size_keys


def schema(what: str) -> dict[str, Any]:
    target = {"config": Config, "manifest": Manifest}[what]
    doc = msgspec.json.schema(target)
    if what == "config":  # sizes also take a unit ("90GB"), read before the types are
        for struct, key in size_keys():
            field = doc["$defs"][struct]["properties"][key]
            field["anyOf"].append({"type": "string", "pattern": SIZE_PATTERN,
                                   "description": SIZE_HELP})
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = f"nvpair {what}"
    return doc


def schema_json(what: str) -> str:
    return msgspec.json.format(msgspec.json.encode(schema(what)), indent=2).decode()
