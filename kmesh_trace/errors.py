"""The error root and its few typed subclasses. Messages are one sentence saying what to do."""


class KmeshTraceError(Exception):
    """Root of every error kmesh-trace raises for a caller's mistake or bad input."""


class SchemaVersionError(KmeshTraceError):
    """Data written under a schema major version this release cannot read."""


class TraceNotFoundError(KmeshTraceError):
    """The path is not a kmesh-trace trace directory."""


class CorruptTraceError(KmeshTraceError):
    """A file inside a trace directory cannot be read (truncated, not JSON/Parquet, missing fields)."""


class QueryRefusedError(KmeshTraceError):
    """A SQL query tried to write, attach, load extensions or read outside the trace."""


class InputFormatError(KmeshTraceError):
    """An input file cannot be read in the format asked for."""


class MissingDependencyError(KmeshTraceError):
    """An optional dependency is not installed; the message gives the install command."""
