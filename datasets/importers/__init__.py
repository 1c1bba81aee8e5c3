"""Importers of public trace formats into trace directories (`kmesh-trace import FORMAT`); what they
share (reading JSONL without losing a line, counting malformed ones) is in `common.py`."""
