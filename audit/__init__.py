"""Audits: is a public agent-trace corpus fit for retention studies, and is a captured trace fit?

`kmesh_trace.audit.corpus.audit_corpus(DIR)` and `kmesh_trace.audit.capture.audit_capture(TRACE)`
return result objects with `.problems`, `.verdict`, `.exit_code` and `.to_dict()`; the CLI
(`kmesh-trace audit corpus|capture`) renders them.
"""
