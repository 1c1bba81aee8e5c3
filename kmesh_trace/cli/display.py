"""The one output layer for people: every line and table a command prints for a human goes through here.

Two guarantees, each held in one place:

- **Data is never interpreted.** The consoles `out` (data, stdout) and `err` (decoration, stderr) are
  `SafeConsole`s: markup, emoji codes and highlighting are off, and every string they render passes
  `visible()` first, which shows control characters (ESC, BEL, CR, backspace, C1 codes, bidirectional
  overrides) as `\\x1b`-style escapes. A family id `[bold red]x[/bold red][link=file:///etc/passwd]y`,
  a `[/oops]` or an ESC byte prints as that literal text: never styled, never a hyperlink, never a
  MarkupError, never a terminal command. Styles come only from `style=` arguments and `Text` spans.
- **Tables fit the terminal.** `Table` keeps rich's `add_column` / `add_row` / `caption` surface, but
  chooses its layout when printed, at the width it is given, the first that fits: the full headers when
  every header and value fits whole (words may wrap, never be cut); the columns' `short=` headers with a
  legend line; the same without the box's rules (columns two spaces apart); and only then one record
  per row (`-[ record N ]-` then one `field  value` line each, as psql's `\\x`), with a line saying how
  wide a terminal shows the table.
  Nothing is ever cut with "…".

Use: `from kmesh_trace.cli.display import Table, out, err` (also re-exported by
`kmesh_trace.cli.common`); build a `Table` as a rich one and `out.print(table)`. Never import
`rich.table` in a command module (tests/test_cli_display.py checks that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported when something is printed, not when a command module loads
    from rich.console import Console, ConsoleOptions, Group, RenderResult
    from rich.measure import Measurement
    from rich.table import Table as RichTable
    from rich.text import Text

__all__ = ["SafeConsole", "Table", "err", "out", "visible", "visible_line"]


def _escape_of(code: int) -> str:
    return {9: "\\t", 10: "\\n", 13: "\\r"}.get(code, f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}")


#: Characters a terminal could act on: C0 controls, DEL, C1 controls, and the invisible bidirectional
#: marks and overrides that reorder what a reader sees ("Trojan source").
_CONTROL = [*range(0, 32), 127, *range(128, 160), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
            *range(0x2066, 0x206A)]
_VISIBLE = {c: _escape_of(c) for c in _CONTROL}
_VISIBLE_KEEP_NEWLINE = {c: v for c, v in _VISIBLE.items() if c != 10}


def visible(value: Any) -> str:
    """`value` as one line of plain text with every control character shown as an escape (`\\x1b`,
    `\\n`): what a table cell or a field of a record prints."""
    return str(value).translate(_VISIBLE)


def visible_line(value: Any) -> str:
    """Like `visible`, keeping line breaks (a message of several lines)."""
    return str(value).translate(_VISIBLE_KEEP_NEWLINE)


_SAFE_CONSOLE = None


def _safe_console_class():
    """`SafeConsole`, defined on first use: rich (~60 ms to import) loads when a command prints, not when
    `kmesh-trace --help` or a command module is imported."""
    global _SAFE_CONSOLE
    if _SAFE_CONSOLE is None:
        from rich.console import Console

        class SafeConsole(Console):
            """A rich Console that never interprets text: no markup, no emoji codes, no highlighting, and every
            string (printed, a table cell, a title, a progress description) made `visible_line` first."""

            def __init__(self, **kwargs):
                super().__init__(markup=False, emoji=False, highlight=False, **kwargs)

            def render_str(self, text: str, **kwargs) -> Text:  # every str this console renders comes here
                kwargs.update(markup=False, emoji=False, highlight=False)
                return super().render_str(visible_line(text), **kwargs)

        SafeConsole.__module__ = __name__
        _SAFE_CONSOLE = SafeConsole
    return _SAFE_CONSOLE


def __getattr__(name: str):
    if name == "SafeConsole":
        return _safe_console_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _OnFirstUse:
    """A SafeConsole made when first used: every attribute (`print`, `file`, `width`, ...) is the console's.
    `console` is the console itself, for rich objects that take one (`Progress(console=err.console)`)."""

    __slots__ = ("_options", "_made")

    def __init__(self, **options):
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_made", None)

    @property
    def console(self):
        made = object.__getattribute__(self, "_made")
        if made is None:
            made = _safe_console_class()(**object.__getattribute__(self, "_options"))
            object.__setattr__(self, "_made", made)
        return made

    @property
    def __dict__(self):  # the console's: what is set here (a test's monkeypatch) is set, and restored, there
        return self.console.__dict__

    def __getattr__(self, name):
        return getattr(self.console, name)

    def __setattr__(self, name, value):
        setattr(self.console, name, value)

    def __delattr__(self, name):
        delattr(self.console, name)


out = _OnFirstUse(soft_wrap=True)  # data
err = _OnFirstUse(stderr=True)  # progress, decoration, errors


def _longest_word(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(w) for w in text.split()), default=0)


def _cell(value: Any) -> Text:
    from rich.text import Text

    return value if isinstance(value, Text) else Text(visible(value))


class _Column:
    __slots__ = ("header", "short", "justify")

    def __init__(self, header: str, short: str | None, justify: str):
        self.header, self.short, self.justify = header, short, justify


class Table:
    """A table that fits the width it is printed at (see the module docstring). The rich keywords a
    command used to pass (`overflow`, `no_wrap`, `title_justify`, `expand`, `pad_edge`) are accepted and
    ignored: the layout is this class's choice."""

    def __init__(self, title: Any = None, *, caption: Any = None, show_header: bool = True, box=None, **_ignored):
        self.title, self.caption, self.show_header = title, caption, show_header
        self.box = box
        self.columns: list[_Column] = []
        self.rows: list[list[Any]] = []

    def add_column(self, header: Any = "", *, justify: str = "left", short: str | None = None, **_ignored) -> None:
        self.columns.append(_Column(visible(header), visible(short) if short else None, justify))

    def add_row(self, *cells: Any) -> None:
        cells = ["" if c is None else c for c in cells]
        self.rows.append(cells + [""] * (len(self.columns) - len(cells)))

    # ---- layout -----------------------------------------------------------------------------

    def _rich(self, headers: list[str], width: int, *, compact: bool = False) -> RichTable | None:
        """The table with these headers at `width` columns, or None when a header or value would be cut.

        Each column gets at least its longest word (a right-justified value, a number: the whole value);
        the room left is shared in proportion to what each column would need to print unwrapped. Widths are fixed here because rich's
        own reduction cuts inside words. `compact`: no box, columns two spaces apart."""
        from rich import box as rich_box
        from rich.cells import cell_len
        from rich.table import Table as RichTable
        from rich.text import Text

        if compact:
            t = RichTable(show_header=self.show_header, box=None, pad_edge=False, padding=(0, 1))
        else:
            t = RichTable(show_header=self.show_header, box=self.box or rich_box.HEAVY_HEAD, pad_edge=self.box is None)
        texts = [[_cell(r[i]).plain for r in self.rows] for i in range(len(self.columns))]
        least = self._least(headers, texts)
        most = [max([cell_len(h)] + [cell_len(x) for x in col]) for h, col in zip(headers, texts)]
        n = len(self.columns)
        if compact:
            frame = 2 * (n - 1)  # one cell of padding each side of every inner edge
        else:
            frame = 2 + (n - 1) + 2 * n - (0 if t.pad_edge else 2)  # edges, separators, padding
        room = width - frame - sum(least)
        if room < 0:
            return None
        if sum(most) > width - frame:  # share the room; otherwise every column prints unwrapped
            want = [m - n for m, n in zip(most, least)]
            total = sum(want) or 1
            least = [n + room * w // total for n, w in zip(least, want)]
        else:
            least = most
        for c, h, w in zip(self.columns, headers, least):
            t.add_column(Text(h, style="bold"), justify=c.justify, overflow="fold", width=w)
        for r in self.rows:
            t.add_row(*(_cell(v) for v in r))
        return t

    def _least(self, headers: list[str], texts: list[list[str]]) -> list[int]:
        """Each column's fewest cells: its longest word (a right-justified value, a number: the whole value)."""
        from rich.cells import cell_len

        return [max([_longest_word(h)] + [cell_len(x) if c.justify == "right" else _longest_word(x) for x in col])
                for c, h, col in zip(self.columns, headers, texts)]

    def _records(self, width: int) -> Group:
        """One record per row: a rule naming it, then `field  value` lines (values wrap, never cut)."""
        from rich.console import Group
        from rich.table import Table as RichTable
        from rich.text import Text

        parts: list[Any] = []
        key_width = max((len(c.header) for c in self.columns), default=0)
        for i, r in enumerate(self.rows, 1):
            if self.show_header:
                parts.append(Text(f"-[ record {i} ]-", style="dim"))
            g = RichTable.grid(padding=(0, 2))
            g.add_column(max_width=min(key_width, max(12, width // 2)), overflow="fold")  # a long key wraps
            g.add_column(overflow="fold")
            for c, v in zip(self.columns, r):
                if self.show_header:
                    g.add_row(Text(c.header, style="bold"), _cell(v))
                else:
                    g.add_row(_cell(r[0]), Text(" ".join(visible(x) for x in r[1:])))
                    break
            parts.append(g)
        return Group(*parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.text import Text

        if self.title is not None:
            yield Text(visible(self.title), style="italic", no_wrap=False, overflow="fold")  # wraps, as prose
        full = [c.header for c in self.columns]
        short = [c.short or c.header for c in self.columns]
        layouts = [(full, None)]
        if short != full:
            legend = ", ".join(f"{c.short} = {c.header}" for c in self.columns if c.short and c.short != c.header)
            layouts.append((short, legend))
        headers, legend = layouts[-1]
        layouts = [(h, lg, {}) for h, lg in layouts] + [(headers, legend, {"compact": True})]
        for headers, legend, how in layouts:
            t = self._rich(headers, options.max_width, **how)
            if t is not None:
                yield t
                if legend:
                    yield Text(f"({legend})", style="dim", no_wrap=False, overflow="fold")
                break
        else:
            yield self._records(options.max_width)
            least = self._least(headers, [[_cell(r[i]).plain for r in self.rows] for i in range(len(self.columns))])
            need = sum(least) + 2 * (len(least) - 1)  # the compact layout's
            yield Text(f"(one record per row: the table needs {need} columns, the terminal has {options.max_width}; "
                       f"a wider terminal, COLUMNS={need}, or --json shows it whole)", style="dim", no_wrap=False,
                       overflow="fold")
        if self.caption:
            for line in str(self.caption).split("\n"):  # a caption's own lines; each one's data made visible
                yield Text(visible(line), style="dim", no_wrap=False, overflow="fold")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        from rich.measure import Measurement

        return Measurement(1, options.max_width)


def say(*parts: Any, console: Console | None = None, style: str | None = None) -> None:
    """Print one line made of `parts` (joined by nothing), every part shown as text."""
    from rich.text import Text

    (console or out).print(Text("".join(visible_line(p) for p in parts), style=style or ""))


def prose(*parts: Any, console: Console | None = None) -> None:
    """Print a sentence (parts joined by nothing, shown as text) wrapped between words at the terminal's width;
    `say` keeps a line of data whole."""
    from rich.text import Text

    (console or out).print(Text("".join(visible_line(p) for p in parts)), soft_wrap=False)


def error_line(message: str) -> str:
    """The `Error: ...` line for a message that may carry data (an engine id, a file name)."""
    return f"Error: {visible(message)}\n"

