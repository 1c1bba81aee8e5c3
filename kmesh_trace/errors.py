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


class NeedsParameterError(KmeshTraceError):
    """An analysis needs a value its caller can give. The message names the parameter as the Python
    API does (`parameter`, e.g. capacity_blocks); the CLI names its own option instead."""

    def __init__(self, reason: str, parameter: str, value: str = ""):
        super().__init__(f"{reason}; give {parameter}" + (f"={value}" if value else "") + ".")
        self.reason, self.parameter, self.value = reason, parameter, value
