"""nvpair's log lines as text and JSON: one line each, whatever a message or an id holds."""

from __future__ import annotations

import json
import logging
import sys

from hypothesis import given
from hypothesis import strategies as st

from nvpair.base.logformat import ACCESS, About, JsonFormat, TextFormat, about

FIELDS = ["time", "level", "logger", "engine", "request_id", "key", "event", "message"]


def record(message: str, name: str = "nvpair.router", **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.WARNING, __file__, 1, "%s", (message,), None)
    rec.__dict__.update(extra)
    return rec


@given(st.text(), st.text(max_size=40))
def test_a_json_line_is_one_line_whatever_the_message_and_the_id(message: str, rid: str) -> None:
    token = about.set(About(rid, engine="e1"))
    try:
        line = JsonFormat().format(record(message))
    finally:
        about.reset(token)
    assert "\n" not in line
    doc = json.loads(line)
    assert list(doc) == FIELDS
    assert (doc["message"], doc["request_id"], doc["engine"], doc["level"]) == (
        message, rid, "e1", "warning")
    assert doc["key"] is None and doc["event"] is None


@given(st.dictionaries(st.sampled_from(["path", "model", "key"]), st.text(max_size=20)))
def test_an_access_line_in_text_is_one_line_of_pairs(fields: dict[str, str]) -> None:
    line = TextFormat().format(record("access", ACCESS, access={"status": 200, **fields}))
    assert "\n" not in line
    assert " access status=200" in line
    for key, value in fields.items():  # each value reads back (quoted where it must be)
        raw = line.split(f" {key}=", 1)[1]
        read = json.JSONDecoder().raw_decode(raw)[0] if raw.startswith('"') else raw.split(" ")[0]
        assert read == (value if value else ""), (key, value, line)


def test_a_text_line_names_its_request_and_engine_and_keeps_the_traceback_below() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("nvpair.router", logging.ERROR, __file__, 1, "relay failed",
                                (), sys.exc_info())
    token = about.set(About("r-9", engine="e1"))
    try:
        text = TextFormat().format(rec)
        doc = json.loads(JsonFormat().format(rec))
    finally:
        about.reset(token)
    first, _, rest = text.partition("\n")
    assert first.endswith("ERROR nvpair.router: relay failed request=r-9 engine=e1")
    assert rest.startswith("Traceback") and "ValueError: boom" in rest
    assert "ValueError: boom" in doc["error"] and doc["request_id"] == "r-9"
    # a line about nothing in particular is as it always was
    plain = TextFormat().format(record("hello"))
    assert plain.endswith("WARNING nvpair.router: hello")
