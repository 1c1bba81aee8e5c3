"""The capture's row layouts (capture/rows.py) are tied to the schema: a mismatch fails at import."""

from __future__ import annotations

import pytest

from kmesh_trace.capture import rows


def test_row_layouts_match_the_schema_and_a_mismatch_fails_at_import(monkeypatch):
    rows._check_layouts()
    monkeypatch.setitem(rows.LAYOUTS, "transfers", rows.TRANSFER_LAYOUT[::-1])
    with pytest.raises(ImportError, match="the transfers row layout"):
        rows._check_layouts()

