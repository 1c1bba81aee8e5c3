"""The CLI starts light (issue 26, item 4): `kmesh-trace --help` and option parsing import none of the
heavy libraries; each is imported by the command that uses it. (The time itself is measured in
benchmarks/startup_bench.py, not here.)"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numpy", "pyarrow", "polars", "duckdb", "numba", "matplotlib", "ray", "torch", "vllm", "jinja2")


def _imported_after(code: str) -> set[str]:
    probe = (f"import sys\n{code}\n"
             f"import json; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_cli_module_imports_no_heavy_library():
    assert _imported_after("import kmesh_trace.cli") == set()


def test_help_of_every_command_imports_no_heavy_library():
    code = ("import contextlib, io, typer.main, kmesh_trace.cli as c\n"
            "cmd = typer.main.get_command(c.app)\n"
            "for name in ['--help', *[[n, '--help'] for n in cmd.commands]]:\n"
            "    args = name if isinstance(name, list) else [name]\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            cmd.main(args, standalone_mode=False)\n"
            "        except SystemExit:\n"
            "            pass\n")
    assert _imported_after(code) == set()
