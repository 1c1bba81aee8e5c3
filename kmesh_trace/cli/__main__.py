"""`python -m kmesh_trace.cli`: the same as the `kmesh-trace` command."""

from kmesh_trace.cli import main

main()
