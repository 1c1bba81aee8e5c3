"""kmesh-trace: capture, analyse and replay the KV-cache life of LLM agent request families.

Three layers, imports pointing one way (base <- analyses <- applications; tests/test_import_graph.py):

- the base, the modules directly in this package: the schema contract (`kmesh_trace.schema`), trace
  writing (`kmesh_trace.writer`), reading (`kmesh_trace.open_trace`), errors, paths, values;
- the analyses: `kmesh_trace.oracle`, audits in `kmesh_trace.audit`, the vLLM plugin in
  `kmesh_trace.capture`, the native replay in `kmesh_trace.native`, importers and workload generators
  in `kmesh_trace.datasets`;
- the applications: the CLI (`kmesh_trace.cli`) and `kmesh_trace.apps` (the report page, plots, the
  Perfetto export, the demo).
"""

from kmesh_trace.errors import KmeshTraceError

__version__ = "0.1.0"
__all__ = ["KmeshTraceError", "SCHEMA_VERSION", "open_trace", "Trace", "__version__"]


def __getattr__(name):
    # Lazy, so that `import kmesh_trace.capture` (in every vLLM process, capture on or off) imports
    # neither pyarrow nor polars nor DuckDB until it needs them.
    if name == "SCHEMA_VERSION":
        from kmesh_trace.schema import SCHEMA_VERSION

        return SCHEMA_VERSION
    if name in ("open_trace", "Trace"):
        from kmesh_trace import trace

        return getattr(trace, name)
    raise AttributeError(name)
