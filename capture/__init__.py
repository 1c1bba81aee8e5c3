"""The capture hook: a vLLM plugin that records a live engine into a trace directory.

Inert unless enabled (`KMESH_TRACE_DIR`, or `kmesh-trace capture`). Enabled, it wraps the engine
core's scheduler, KV cache manager and block pool of each engine process (instance by instance,
never the classes' code) and records invocations, lineage, physical block events and, through the
proxy KV connector, transfers. Everything here imports only the schema, the writer, the error
types, pyarrow, the standard library and vLLM: never polars or DuckDB in the engine process.
"""
