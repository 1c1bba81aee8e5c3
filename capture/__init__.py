"""The capture hook: a vLLM plugin that records a live engine into a trace directory.

Inert unless enabled (`KMESH_TRACE_DIR`, or `kmesh-trace capture`). Enabled, it wraps the scheduler
constructor; each engine core's scheduler, KV cache manager and block pool then get instance-level
wrappers (vLLM's code is never changed) that record invocations, lineage, physical block events
and, through the proxy KV connector, transfers. The opt-in family hold controller (`hold.py`,
`KMESH_HOLD=1`) lives here too. Everything here imports only the schema, the writer, the error
types, the hold rule it shares with the what-if (`kmesh_trace.holds`), pyarrow, the standard library and vLLM: never polars or DuckDB in the engine process.
"""
