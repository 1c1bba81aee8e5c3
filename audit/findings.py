"""What an audit reports: problems with a severity, and the exit code they imply.

Both audits (corpus and capture) return problems in this one shape so the CLI renders and maps them
to exit codes the same way: any `blocking` problem means exit 3, warnings alone mean exit 0.
A problem carries counts, names and locations only, never record content.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

BLOCKING = "blocking"
WARNING = "warning"

EXIT_CLEAN = 0
EXIT_PROBLEMS = 3


@dataclass
class Problem:
    code: str
    severity: str
    count: int
    message: str
    #: Up to a few `file:line` (corpus) or `table:engine:seq` (capture) locations, first first.
    locations: list[str] = field(default_factory=list)
    #: Analyses this problem stops from qualifying (capture audits; corpus verdicts list their own).
    blocks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def exit_code(problems: list[Problem]) -> int:
    return EXIT_PROBLEMS if any(p.severity == BLOCKING for p in problems) else EXIT_CLEAN


def summary(problems: list[Problem]) -> str:
    """One line naming the blocking problems, for the CLI's last word."""
    blocking = [p for p in problems if p.severity == BLOCKING]
    if not blocking:
        n = len(problems)
        return "nothing blocking" + (f" ({n} warning{'s' if n != 1 else ''})" if n else "")
    codes: dict[str, int] = {}
    for p in blocking:
        codes[p.code] = codes.get(p.code, 0) + 1
    names = ", ".join(c if n == 1 else f"{c} (x{n})" for c, n in codes.items())
    return f"{len(blocking)} blocking problem{'s' if len(blocking) != 1 else ''}: {names}"
