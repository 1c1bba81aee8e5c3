"""The applications: what a user runs on top of the analyses, above them in the import graph.

The report page (`report`), the plots (`plots`), the Perfetto timeline export (`perfetto`), the demo
(`demo`) and the tiny CPU vLLM engine it and the tests drive (`tiny_engine`). Together with the CLI
(`kmesh_trace.cli`) they form the top layer: they import the analyses (`kmesh_trace.oracle`, `.audit`,
`.capture`, `.native`, `.datasets`) and the base (the modules directly in `kmesh_trace/`); nothing
below imports them (tests/test_import_graph.py checks it).
"""
