"""Golden tests as data, in the style of Perfetto's diff tests: every case of tests/golden/cases.txt (an input, a
command line) runs the CLI, and its output, made stable by `normalise`, must equal tests/golden/expected/NAME.*.

`KMESH_UPDATE_GOLDEN=1` rewrites the expectations instead of comparing (then review `git diff tests/golden`).
The cases run in-process (one CLI start for all of them); `KMESH_GOLDEN_RUNNER=subprocess` runs each as its own
`kmesh-trace` process instead, as a user would (the same expectations hold for both).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import golden_inputs

GOLDEN = Path(__file__).resolve().parent / "golden"
EXPECTED = GOLDEN / "expected"
UPDATE = os.environ.get("KMESH_UPDATE_GOLDEN") == "1"
COLUMNS = 100


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    append: str | None  # a file whose contents follow the output (what an export wrote)

    @property
    def expected(self) -> Path:
        return EXPECTED / f"{self.name}.{'json' if '--json' in self.args else 'txt'}"


def read_cases(path: Path = GOLDEN / "cases.txt") -> list[Case]:
    cases = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        command, _, append = rest.partition("  @ ")
        cases.append(Case(name, tuple(shlex.split(command)), append.strip() or None))
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names repeat"
    return cases


CASES = read_cases()

# JSON members whose values differ from run to run or machine to machine: the clock, the host, the versions.
_VOLATILE_KEYS = ("host", "mono_anchor_ns", "wall_anchor_ns", "created_at", "created_ns", "started_at", "ended_at",
                  "kmesh_trace_version", "python", "platform", "pid", "elapsed_s", "wall_s", "seconds_taken")


def normalise(text: str, work: Path, inputs: Path | None = None) -> str:
    """The one place volatile output is made stable: the scratch and input paths become {work} and {in} (also
    where a table cell wrapped them), and the values of `_VOLATILE_KEYS` (times, host, versions, durations)
    become "<volatile>"."""
    for path, tag in ((str(inputs or golden_inputs.INPUTS), "{in}"), (str(work), "{work}"), (str(golden_inputs.INPUTS), "{in}")):
        text = text.replace(path, tag)
    keys = "|".join(_VOLATILE_KEYS)
    text = re.sub(rf'("(?:{keys})": )(?:"[^"]*"|-?[0-9.e+-]+|null)', r'\1"<volatile>"', text)
    text = re.sub(r'("\w+_ns": )1[0-9]{18}\b', r'\1"<volatile>"', text)  # a wall clock, in ns since 1970
    # The same values as rows of a key | value table (`info`): the value cell, padded to its width.
    text = re.sub(rf'(│ (?:{keys}) +│ )(\S+)( *)(?=│)|(│ \w+_ns +│ )(1[0-9]{{18}})( *)(?=│)',
                  lambda m: (m[1] or m[4]) + "<volatile>".ljust(len(m[2] or m[5]) + len(m[3] or m[6])), text)
    return text


def _render(stdout: str, stderr: str, code: int, appended: str | None) -> str:
    text = stdout
    if appended is not None:
        text += "---- file\n" + appended
    if stderr:
        text += "---- stderr\n" + stderr
    if code:
        text += f"---- exit {code}\n"
    return text


def _fix_width() -> None:
    """Tables at COLUMNS wide in-process, as a process started with COLUMNS renders them."""
    try:
        from kmesh_trace.cli import display
    except ImportError:
        return
    for name in ("out", "err"):
        console = getattr(display, name, None)
        if console is not None:
            console._width = COLUMNS


def _run_all(work: Path) -> dict[str, str]:
    golden_inputs.record_listen(work / "listen")
    # The inputs are read from a copy inside the scratch directory, whose path has one length on every machine
    # (see `outputs`): a table that shows a path wraps where it wraps in the expectation.
    inputs = work / "in"
    shutil.copytree(golden_inputs.INPUTS, inputs)
    env = {"COLUMNS": str(COLUMNS), "TERM": "dumb", "NO_COLOR": "1"}
    subs = {"{in}": str(inputs), "{work}": str(work)}

    def expand(s: str) -> str:
        for k, v in subs.items():
            s = s.replace(k, v)
        return s

    in_process = os.environ.get("KMESH_GOLDEN_RUNNER", "in-process") != "subprocess"
    if in_process:
        from typer.testing import CliRunner

        from kmesh_trace.cli import app

        runner = CliRunner(env=env)
    outputs = {}
    for case in CASES:
        args = [expand(a) for a in case.args]
        if in_process:
            _fix_width()
            r = runner.invoke(app, args)
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                raise r.exception
            stdout, stderr, code = r.stdout, r.stderr, r.exit_code
        else:
            exe = Path(sys.executable).with_name("kmesh-trace")
            p = subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=work, timeout=600,
                               env={**os.environ, **env})
            stdout, stderr, code = p.stdout, p.stderr, p.returncode
        appended = Path(expand(case.append)).read_text() if case.append else None
        outputs[case.name] = normalise(_render(stdout, stderr, code, appended), work, inputs)
    return outputs


@pytest.fixture(scope="module")
def outputs(monkeypatch_module):
    # Not pytest's tmp_path, whose length grows with its run counter (pytest-9, pytest-10): /tmp/kmesh-golden-XXXXXXXX.
    work = Path(tempfile.mkdtemp(prefix="kmesh-golden-", dir="/tmp"))
    monkeypatch_module.chdir(work)
    try:
        yield _run_all(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden(case, outputs):
    got = outputs[case.name]
    if UPDATE:
        case.expected.parent.mkdir(parents=True, exist_ok=True)
        case.expected.write_text(got)
        return
    assert case.expected.is_file(), f"no expectation for {case.name}: run with KMESH_UPDATE_GOLDEN=1"
    assert got == case.expected.read_text(), f"{case.name}: `kmesh-trace {shlex.join(case.args)}` changed its output"


def test_every_expectation_has_its_case():
    names = {c.expected.name for c in CASES}
    assert sorted(p.name for p in EXPECTED.iterdir() if p.name not in names) == []


def test_inputs_are_what_the_generator_writes():
    assert {str(p.relative_to(golden_inputs.INPUTS)): p.read_text() for p in sorted(golden_inputs.INPUTS.rglob("*"))
            if p.is_file()} == golden_inputs.files()


def test_normalise_hides_paths_and_volatile_values(tmp_path):
    text = (f'{{"path": "{tmp_path}/mc", "host": "vm", "mono_anchor_ns": 12, "wall_ns": 1796222173226288845, '
            f'"ts_ns": 100, "n": 3}}\n{golden_inputs.INPUTS}/a.jsonl\n'
            '│ host           │ vm                  │\n│ wall_anchor_ns │ 1796222175333277623 │\n│ n              │ 3  │\n')
    assert normalise(text, tmp_path) == (
        '{"path": "{work}/mc", "host": "<volatile>", "mono_anchor_ns": "<volatile>", "wall_ns": "<volatile>", '
        '"ts_ns": 100, "n": 3}\n{in}/a.jsonl\n'
        '│ host           │ <volatile>          │\n│ wall_anchor_ns │ <volatile>          │\n│ n              │ 3  │\n')
