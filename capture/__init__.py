"""The capture hook: a vLLM plugin that records a live engine into a trace directory.

Inert unless enabled (`KMESH_TRACE_DIR`, or `kmesh-trace capture`). Enabled, it wraps the scheduler
constructor; each engine core's scheduler, KV cache manager and block pool then get instance-level
wrappers (vLLM's code is never changed) that record invocations, lineage, physical block events
and, through the proxy KV connector, transfers. The opt-in family hold controller (`hold.py`,
`KMESH_HOLD=1`) lives here too.

Where each job lives: `plugin.py` (the entry point), `hooks.py` (starting and closing a capture,
the recorders of this process), `wrappers.py` (what is attached to the pool, manager and scheduler),
`attach.py` (the one detachable way of wrapping methods), `recorder.py` (buffers, the writer thread
and the small API the hold controller and proxy connector use), `rows.py` (row layouts tied to the
schema, the `vllm_xargs` parser, the caller-id rule, hashes), `buffers.py`, `lineage.py` (exact-prefix
inference; declared parents are resolved by `kmesh_trace.lineage`), `config.py` and `env.py` (knobs),
`hold.py`, `connector.py`, `session.py` (in-process capture), `version.py` (the version guard).

Everything here imports only the schema, the writer, the error types, the lineage resolver
(`kmesh_trace.lineage`), the hold rule it shares with the what-if (`kmesh_trace.holds`), pyarrow, the standard library and vLLM: never polars or DuckDB in the engine process.
"""
