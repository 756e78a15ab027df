"""The stderr record, as the daemon writes it without a journal: every field reads back as it
was logged, whatever its value holds (the tests read the records this way)."""

from __future__ import annotations

import io
import logging

from inboxd import logs

from tests.conftest import line_fields

AWKWARD_VALUES = {
    "plain": "a.jpg",
    "spaces": "two  words",
    "quotes": "it's \"x\"",
    "equals": "A=B and C='D'",
    "json": '{"vm:1":{"p50_ms":1.0}}',
    "backslashes": "tab\there \\back\\",
    "empty": "",
    "unicode": "Fotó 2026.heic",
}


def test_every_field_of_a_stderr_record_reads_back_as_logged(stderr_records: io.StringIO) -> None:
    logs.emit(logging.INFO, "stats", "a message with X=1 and 'quotes' in it",
              count=3, ratio=0.25, **AWKWARD_VALUES)
    line = stderr_records.getvalue().rstrip("\n")
    assert "\n" not in line, "one record, one line"
    fields = line_fields(line)
    expected = {key.upper(): value for key, value in AWKWARD_VALUES.items()}
    assert {key: fields.get(key) for key in expected} == expected, line
    assert (fields["COUNT"], fields["RATIO"]) == ("3", "0.25")
