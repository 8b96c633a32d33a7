"""JSON Schemas of the config and the manifests, generated from the msgspec types."""

from __future__ import annotations

from typing import Any

import msgspec

from nvpair.config import Config
from nvpair.manifest import Manifest


def schema(what: str) -> dict[str, Any]:
    target = {"config": Config, "manifest": Manifest}[what]
    doc = msgspec.json.schema(target)
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = f"nvpair {what}"
    return doc


def schema_json(what: str) -> str:
    return msgspec.json.format(msgspec.json.encode(schema(what)), indent=2).decode()
