"""What every CLI command shares: consoles (data to stdout, decoration to stderr), error handling, the
checks of option values (integer lists, output paths) that must fail before any work is done, and the
output options and exit codes of every analysis command.

Human output goes through ONE layer, `kmesh_trace.cli.display` (re-exported here as `out`, `err` and
`Table`): its consoles never interpret text (no markup, control characters shown as escapes), so a
string from a trace, a corpus or a flag prints as itself; its `Table` fits the terminal (short headers
with a legend, else one record per row) and never cuts a value with "…". A new command builds its tables
with `Table(...)` / `add_column(header, justify=..., short=...)` / `add_row(...)` and prints them with
`out.print(table)`; it never imports `rich.table` and never passes markup.

Paths go through ONE policy, `kmesh_trace.paths` (re-exported here as `check_out_file`,
`check_out_dir`, `check_out_not_in_input`): an output is never an input nor inside one, and a trace's
parts never lie outside its directory. Memory goes through `kmesh_trace.resources.check_fits`: a
command that allocates from a flag (`--capacity-blocks`, `--engines`, `--arrival users:N`) estimates
the bytes first and refuses, naming the flag, what the machine cannot hold.

Output options (`output_options` + `emit`): a command that produces a result adds `--json`, `--csv`
(when its result is one table) and `--out FILE` (the JSON, or the CSV with --csv, written atomically
while the human output still goes to the terminal) in two lines:

    @handles_errors
    @output_options(csv=True, blocking="the audit found a blocking problem")
    def my_cmd(trace: Path = typer.Argument(...), output: Output = None) -> None:
        \"\"\"One sentence of help.\"\"\"
        result = analyse(trace)
        emit(output, result.to_dict(), rows=result.rows(), render=lambda: out.print(table_of(result)))

The decorator replaces the `output` parameter with the three options, refuses --json with --csv and
an unwritable --out before any work, and appends the exit codes to the command's help. Commands whose
`--out` is already their product (a trace directory, an export file, a results directory) take only
`JsonOption` and `exit_codes_help`.

Exit codes: 0 ok; 1 could not run (usage, input, I/O); 3 ran and found a blocking problem (an audit's
blocking finding, a replay whose verification failed).
"""

from __future__ import annotations

import errno
import functools
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from kmesh_trace.cli.display import Table, err, out  # noqa: F401  (the one output layer, re-exported)
from kmesh_trace.cli.flags import flags
from kmesh_trace.errors import KmeshTraceError, NeedsParameterError
from kmesh_trace.values import MAX_BLOCKS, MAX_KV_BYTES_PER_TOKEN, bounded_int, json_text
from kmesh_trace.paths import check_out_dir, check_out_file, check_out_not_in_input  # noqa: F401  (re-exported)


def fail(message: str, code: int = 1) -> None:
    """Print one `Error: ...` line on stderr and exit with `code`."""
    err.print(f"Error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handles_errors(fn: Callable) -> Callable:
    """Turn a KmeshTraceError (or an unreadable file) into one `Error:` line and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KmeshTraceError as e:
            fail(cli_message(e))
        except OSError as e:
            if e.errno == errno.EPIPE or e.strerror is None:
                raise  # a closed pipe is quiet; an OSError without an errno is not the environment's
            fail(os_error_message(e))
        except MemoryError:
            fail("this machine ran out of memory for the command; ask for less (a smaller --capacity-blocks, "
                 "fewer rows) or run it on a larger machine.")
        except Exception as e:
            damage = _read_damage(e)
            if damage is None:
                raise
            fail(str(damage))

    return wrapper


#: Analysis parameters (as NeedsParameterError names them) -> the option every command gives them.
OPTION_OF_PARAMETER = {"capacity_blocks": "--capacity-blocks", "engine": "--engine", "edges": "--edges"}


def cli_message(e: KmeshTraceError) -> str:
    """An error's one sentence for the command line: an analysis names its parameters, the CLI its options."""
    if isinstance(e, NeedsParameterError) and e.parameter in OPTION_OF_PARAMETER:
        return f"{e.reason}; pass {OPTION_OF_PARAMETER[e.parameter]}" + (f" {e.value}" if e.value else "") + "."
    return str(e)


def os_error_message(e: OSError) -> str:
    """An operating-system refusal as one sentence: what failed, on which file, and what to do."""
    hint = {errno.ENOSPC: "free some space or write elsewhere", errno.EROFS: "write to a writable filesystem",
            errno.EDQUOT: "free some space or write elsewhere", errno.EACCES: "check its permissions",
            errno.EPERM: "check its permissions"}.get(e.errno)
    where = f": {e.filename}" if e.filename is not None else ""
    return f"{e.strerror}{where}" + (f"; {hint}." if hint else "")


def _read_damage(e: Exception):
    """A decoding error from polars, Arrow or DuckDB while a trace is open: the damaged part, if one is."""
    if type(e).__module__.split(".")[0] not in ("polars", "pyarrow", "duckdb", "_duckdb"):
        return None
    from kmesh_trace.trace import locate_damage

    return locate_damage(e)


def check_plot_option(plot: Path | None, inputs: "list[Path | str | None]") -> None:
    """`--plot FILE`, refused before any work: a .png or .svg the command can write, not inside an input."""
    if plot is None:
        return
    from kmesh_trace.apps.plots import check_plot_path

    check_out_file(check_plot_path(plot), "--plot")
    check_out_not_in_input(plot, inputs, "--plot")


#: Block counts are int32 in the contract (block ids); a larger capacity names no pool.
MAX_BLOCKS = (1 << 31) - 1


def parse_ints(text: str, what: str, maximum: int = MAX_BLOCKS) -> list[int]:
    """Comma-separated integers above zero and at most `maximum` (`--capacity-blocks 256,512`); an empty
    item, a non-integer or a value out of range is one error naming the option `what`."""
    try:
        values = [int(x) for x in text.split(",")]  # int("") fails: an empty item is refused too
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise KmeshTraceError(f"{what} must be comma-separated integers above zero, e.g. 256,512,1024 (got {text!r}).")
    if any(v > maximum for v in values):
        raise KmeshTraceError(f"{what} values must be at most {maximum:,} (got {text!r}).")
    return values


def print_json(obj: Any) -> None:
    sys.stdout.write(json_text(obj) + "\n")
    sys.stdout.flush()


def progress(transient: bool = True):
    """A rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err.console, transient=transient)


# ---- output options and exit codes ---------------------------------------------------------------

EXIT_OK = 0
EXIT_COULD_NOT_RUN = 1
EXIT_BLOCKING = 3

JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output: JSON on stdout.")]
CsvOption = Annotated[bool, typer.Option("--csv", help="The result table as CSV on stdout.")]
OutOption = Annotated[Optional[Path], typer.Option(
    "--out", help="Write the result to FILE instead of stdout: the --json document (or CSV with --csv), written "
                  "atomically; stdout stays empty.")]
#: --out of a command without --csv: its help names only the JSON.
JsonOutOption = Annotated[Optional[Path], typer.Option(
    "--out", help="Write the result to FILE instead of stdout: the --json document, written atomically; stdout "
                  "stays empty.")]


def exit_codes_help(blocking: str | None = None) -> str:
    """The exit-code paragraph of a command's --help; `blocking` says when the command exits 3."""
    text = "Exit codes: 0 ok; 1 could not run (usage, input or I/O error)"
    return text + (f"; 3 ran and {blocking}." if blocking else ".")


@dataclass(frozen=True)
class Output:
    """What the user asked for: JSON or CSV on stdout (else the human rendering), and a file copy."""

    json: bool = False
    csv: bool = False
    out: Path | None = None


#: Parameters of commands that name what the command reads; `--out` may not lie inside any of them.
INPUT_PARAMETERS = ("trace", "directory", "src", "store", "restore_results", "model_config")


def output_options(*, csv: bool = False, blocking: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: give the command `--json`, `--csv` (with `csv=True`) and `--out FILE`, passed to it as
    its `output: Output` parameter, and the exit codes in its help (`blocking`: when it exits 3)."""

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        if "output" not in sig.parameters:
            raise TypeError(f"{fn.__name__} needs an `output` parameter to use output_options")
        extra = [inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=JsonOption)]
        if csv:
            extra.append(inspect.Parameter("as_csv", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=CsvOption))
        extra.append(inspect.Parameter("out_file", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=OutOption if csv else JsonOutOption))
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                  else p for p in sig.parameters.values() if p.name != "output"]

        @functools.wraps(fn)
        def wrapper(*args, as_json: bool = False, as_csv: bool = False, out_file: Path | None = None, **kwargs):
            if as_json and as_csv:
                raise KmeshTraceError("give --json or --csv, not both.")
            if out_file is not None:  # refuse it before the work, not after; never inside an input
                check_out_file(out_file, "--out")
                check_out_not_in_input(out_file, [v for k, v in kwargs.items()
                                                  if k in INPUT_PARAMETERS and isinstance(v, (str, Path))])
            return fn(*args, output=Output(as_json, as_csv, out_file), **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params + extra)
        wrapper.__annotations__ = {p.name: p.annotation for p in params + extra}
        wrapper.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{exit_codes_help(blocking)}"
        return wrapper

    return decorate


def csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts) as CSV with a header line; columns in first-seen order, nested values as JSON."""
    import csv
    import io
    import json

    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return buf.getvalue()


def emit(output: Output, data: Any, *, rows: list[dict[str, Any]] | None = None,
         render: Callable[[], None] | None = None) -> None:
    """Deliver a command's result as the user asked: with --out, only the file (`data` as JSON, or `rows` as
    CSV with --csv); else `data` for --json, `rows` (the result's table) for --csv, `render()` (rich tables)."""
    if output.csv and rows is None:
        raise KmeshTraceError("this result is not one table; use --json.")
    if output.out is not None:
        from kmesh_trace.writer import atomic_output  # pyarrow: only when a file is written

        text = csv_text(rows) if output.csv else json_text(data) + "\n"
        with atomic_output(output.out) as tmp:
            tmp.write_text(text)
        err.print(f"wrote {output.out}", markup=False, highlight=False, soft_wrap=True)
        return  # the file is the output: nothing on stdout, with or without --json
    if output.json:
        print_json(data)
    elif output.csv:
        sys.stdout.write(csv_text(rows))
        sys.stdout.flush()
    elif render is not None:
        render()


def _scenario_enum():
    from enum import Enum

    from kmesh_trace.datasets.workloads import SCENARIOS

    return Enum("ScenarioName", {name.replace("-", "_"): name for name in SCENARIOS}, type=str)


ScenarioName = _scenario_enum()
ScenarioOption = Annotated[Optional[ScenarioName], typer.Option(
    "--scenario", help="Analyse a built-in workload (kmesh_trace.datasets.workloads) instead of a trace.")]
CapacityOption = Annotated[Optional[str], typer.Option(
    "--capacity-blocks", help="Pool capacities in blocks, comma-separated, e.g. 256,512 (default: the trace's usable blocks).")]
CapacityBytesOption = Annotated[Optional[str], typer.Option(
    "--capacity", help="Pool capacities, comma-separated: blocks, or bytes with a unit (40GiB) converted with the KV "
                       "bytes per token.")]
KvBytesOption = Annotated[Optional[int], typer.Option(
    "--kv-bytes-per-token", parser=bounded_int(1, MAX_KV_BYTES_PER_TOKEN),
    help="KV bytes per token, for --capacity in bytes (default: the capture's engine metadata).")]
ModelConfigOption = Annotated[Optional[Path], typer.Option(
    "--model-config", help="Hugging Face config.json giving the KV bytes per token, for --capacity in bytes.")]
TraceArgument = Annotated[Path, typer.Argument(help="Trace directory.")]
SummaryJsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable summary.")]
KvModelConfigOption = Annotated[Optional[Path], typer.Option(
    "--model-config", help="Hugging Face config.json giving the KV bytes per token.")]
PartitionOption = Annotated[Optional[str], typer.Option("--engine", help="Only this engine partition.")]
TraceOrScenarioArgument = Annotated[Optional[Path], typer.Argument(
    help="Trace directory, or a Mooncake/Bailian JSONL file or weka directory, read as it is, or an lmcache-agent "
         "directory, imported on the way in (or use --scenario).")]
EngineOption = Annotated[Optional[str], typer.Option("--engine", help="Engine partition, for traces with several.")]
AllowIncompleteOption = Annotated[bool, typer.Option(
    "--allow-incomplete", help="Analyse a capture that never closed (complete: false) with a warning, instead of refusing.")]


def ray_option(more: str = ""):
    """`--ray` (its help: how to reach Ray, then `more`)."""
    from kmesh_trace.distributed import RAY_HELP

    return Annotated[Optional[str], typer.Option("--ray", help=RAY_HELP + more)]


def plot_option(what: str):
    """`--plot FILE` with the help `what` (what the plot draws, when)."""
    return Annotated[Optional[Path], typer.Option("--plot", help=what)]


RayOption = ray_option()


@flags
class CapacityBytesFlags:
    """Pool capacities given with a unit (--capacity 40GiB) and the KV geometry that turns bytes into blocks."""

    capacity: CapacityBytesOption = None
    kv_bytes: KvBytesOption = None
    model_config: ModelConfigOption = None

    def check_once(self, capacity_blocks: str | None) -> None:
        """Refuse capacities given twice (in blocks and with --capacity)."""
        one_capacity_flag(capacity_blocks, self.capacity)

    def in_blocks(self, trace, workload, engine: str | None) -> tuple[int, ...]:
        """--capacity in blocks with the geometry of an analysis' input (`capacities_of_input`)."""
        return capacities_of_input(self.capacity, trace, workload, engine, self.kv_bytes, self.model_config)


@flags
class RequestDatasetFlags:
    """A request dataset's tokenizer and tokens per block (`--tokenizer`, `--block-size`), for its import on the
    way into an analysis; refused for any other input. One block, named by every command that reads one."""

    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", help="A request dataset's tokenizer: tokenizer.json, or its directory with "
        "tokenizer_config.json and the chat template, e.g. your own model directory, the one `vllm serve` loads "
        "(default: UTF-8 bytes, approximate).")
    block_size: Optional[int] = typer.Option(
        None, "--block-size", parser=bounded_int(1, MAX_BLOCKS),
        help="A request dataset's tokens per block (default 16 with --tokenizer, 64 for UTF-8 bytes).")

    def import_options(self, trace) -> dict | None:
        """The importer's options for input `trace` (None when neither flag is given)."""
        if self.tokenizer is None and self.block_size is None:
            return None
        from kmesh_trace.sources import sniff

        if trace is None or sniff(trace) != "requests":
            raise KmeshTraceError("--tokenizer and --block-size apply to a request dataset (OpenAI-compatible JSONL, "
                                  "ShareGPT, vllm bench custom).")
        return {"tokenizer": self.tokenizer, "block_size": self.block_size}


def capacities_in_blocks(text: str, block_size: int, meta: dict, kv_bytes: int | None, model_config) -> tuple[int, ...]:
    """`--capacity` as block counts: plain numbers are blocks, sizes with a unit are bytes over the block's bytes
    (the KV bytes per token from `kv_bytes` or `model_config`, else the engine metadata `meta`). A hybrid
    engine's pool block is the bytes of its KV cache groups' pages (`hybrid_pool.pool_block_bytes`)."""
    from kmesh_trace.kv_groups import groups_from_metadata, is_hybrid
    from kmesh_trace.oracle.hybrid_pool import pool_block_bytes
    from kmesh_trace.oracle.tier_costs import kv_bytes_per_token, parse_capacity

    groups = groups_from_metadata(meta) if meta.get("kv_cache_groups") else ()
    if is_hybrid(groups):
        block_bytes = pool_block_bytes(groups)
        if block_bytes is None and any(ch.isalpha() for ch in text):
            raise KmeshTraceError("--capacity is given in bytes, but the engine's KV cache groups do not state their "
                                  "page sizes and layers; give blocks.")
    else:
        kvbpt, _ = kv_bytes_per_token(meta, kv_bytes, model_config)
        block_bytes = block_size * kvbpt if kvbpt else None
    caps = [parse_capacity(c, block_bytes, "--capacity") for c in text.split(",") if c.strip()]
    if not caps or min(caps) <= 0:
        raise KmeshTraceError(f"--capacity must give capacities of at least one block ({block_size} tokens"
                              f"{f', {block_bytes:,} bytes' if block_bytes else ''}); got {text!r}.")
    return tuple(caps)


def capacities_of_input(text: str, trace, workload, engine: str | None, kv_bytes: int | None,
                        model_config) -> tuple[int, ...]:
    """`--capacity` with the geometry of an analysis' input: the trace's engine partition (`open_input`'s
    trace), else the scenario's workload (which has no KV geometry of its own)."""
    if trace is None:
        return capacities_in_blocks(text, workload.block_size, {}, kv_bytes, model_config)
    from kmesh_trace.oracle.stream import engine_geometry

    meta = trace.engines[engine] if engine is not None else trace.metadata
    return capacities_in_blocks(text, engine_geometry(trace, engine)[0], meta, kv_bytes, model_config)


def one_capacity_flag(capacity_blocks: str | None, capacity: str | None) -> None:
    """Refuse capacities given twice (in blocks and with --capacity)."""
    if capacity is not None and capacity_blocks is not None:
        raise KmeshTraceError("give the capacities once: --capacity or --capacity-blocks.")


def build_scenario(scenario):
    """The Workload of a --scenario value, its notes printed on stderr."""
    from kmesh_trace.datasets.workloads import get

    built = get(scenario.value).build()
    for note in built.notes:
        err.print(f"note: {scenario.value}: {note}", markup=False, highlight=False)
    return built


@contextmanager
def open_input(trace, scenario, engine: str | None, allow_incomplete: bool, *, direct: bool = False,
               import_options: dict | None = None):
    """(the opened trace, None) for a TRACE argument, checked as every analysis checks it (requests, a
    complete capture), or (None, its Workload) for a --scenario; the trace stays open inside the block.
    TRACE may be a public trace read as it is (a Mooncake or Bailian JSONL file, a weka or lmcache-agent
    directory: `kmesh_trace.sources`). With `direct`, for a command that reads only the workload, the
    engine metadata and the notes below, a format that `read_directly` reads comes as its `PublicInput`
    (in memory, complete, with requests) instead of an imported trace. `import_options` go to the importer of
    a public trace (a request dataset's tokenizer and block size)."""
    if scenario is not None:
        yield None, build_scenario(scenario)
        return
    if direct:
        from kmesh_trace.sources import read_directly

        public = read_directly(trace, on_import=err.print)
        if public is not None:
            yield public, None
            return
    from kmesh_trace.audit.capture import check_complete
    from kmesh_trace.sources import open_as_trace
    from kmesh_trace.trace import check_has_requests

    with open_as_trace(trace, on_import=err.print, until_exit=True, import_options=import_options) as t:
        check_has_requests(t)
        check_complete(t, engine, allow_incomplete, lambda line: err.print(line, markup=False, highlight=False))
        yield t, None


@contextmanager
def progress_of(executor, label: str, *, always: bool = False):
    """A progress bar advancing as `executor`'s tasks complete: for remote (Ray) tasks, or `always`."""
    if not (always or executor.remote):
        yield
        return
    with progress() as bar:
        tid = bar.add_task(label, total=None)
        executor.on_start = lambda n: bar.update(tid, total=n)
        executor.on_done = lambda task: bar.advance(tid)
        yield


def approximate_tokens_note(trace) -> str | None:
    """Say on stderr (and return) that a trace's token ids are an importer's approximation, when they are."""
    if not any(m.get("token_ids_approximate") for m in trace.engines.values()):
        return None  # as approximate_tokens says, without loading kmesh_trace.trace (polars, pyarrow, duckdb)
    from kmesh_trace.trace import approximate_tokens

    note = approximate_tokens(trace)
    if note:
        err.print(f"note: {note}", markup=False, highlight=False)
    return note
