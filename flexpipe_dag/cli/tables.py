"""Human output of the CLI: numbers readable at any magnitude, tables that fit any width, ids never cut.

* :func:`format_number` (from :mod:`flexpipe_dag.core.numbers`) writes a figure with thousands separators
  while it is short enough to read, then in scientific notation (``1.5e+07``); a missing value or NaN is ``-``.
* :func:`new_table` builds a ``rich`` table whose id columns never wrap and are never ellipsised
  (an id longer than the whole terminal folds onto the next line, every character kept), whose
  numeric columns are right-justified and fold rather than cut, and whose text columns wrap at spaces.
* :func:`cli_console` is the console the commands print to; :func:`render_text` renders to a string.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Collection, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from flexpipe_dag.core.numbers import format_number  # the CLI's modules import it from here

#: Width of a console that is not a terminal (a pipe or a file) when ``COLUMNS`` does not say.
PIPE_WIDTH = 160


def format_pair(a: Any, b: Any, decimals: int = 1) -> str:
    """Two figures of one cell, ``a / b`` (e.g. P50 / P99), each by :func:`format_number`."""
    return f"{format_number(a, decimals)} / {format_number(b, decimals)}"


def format_range(lo: Any, hi: Any, decimals: int = 2) -> str:
    """A range ``lo..hi`` (e.g. a request-rate envelope), each end by :func:`format_number`."""
    return f"{format_number(lo, decimals)}..{format_number(hi, decimals)}"


class IdTable(Table):
    """A :class:`rich.table.Table` that fits any console width without cutting an id or a figure.

    At each render it measures every column (header and cells): the widest cell (``max``) and the
    widest word (``min``; an id or a figure is one word). If the natural widths fit, they are used;
    else, if every column fits at its widest word, the spare width goes to the columns that wrap
    (headers and text wrap at spaces, nothing folds); else the rows are printed as records, one
    block per row headed by its id (see :meth:`records`), so a narrow terminal still shows every id
    whole and every figure apart. Id columns are those added by :func:`add_id_column`.
    """

    id_headers: set[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.id_headers = set()

    def _chrome_width(self) -> int:
        """Borders and padding of one line (every column), the width no content can use."""
        borders = (2 if self.box and self.show_edge else 0) + (len(self.columns) - 1 if self.box else 0)
        pad_left, pad_right = self.padding[3], self.padding[1]
        return borders + (pad_left + pad_right) * len(self.columns)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Lay the columns out for ``options.max_width`` (see the class), then render."""
        for column in self.columns:
            column.width = None
        max_width = self.width if self.width is not None else options.max_width
        available = max_width - self._chrome_width()
        ranges = []
        for column in self.columns:
            cells = (column.header, *column.cells)
            sizes = [Measurement.get(console, options.update_width(10**6), cell) for cell in cells]
            ranges.append((max(m.minimum for m in sizes), max(m.maximum for m in sizes)))
        if sum(hi for _, hi in ranges) <= available:
            yield from super().__rich_console__(console, options)
            return
        if sum(lo for lo, _ in ranges) > available:
            yield from self.records(console, options)
            return
        widths = [lo for lo, _ in ranges]
        spare = available - sum(widths)
        # the spare width unwraps the columns nearest their natural width first: most columns on one line
        for gap, index in sorted((hi - lo, i) for i, (lo, hi) in enumerate(ranges) if hi > lo):
            widths[index] += min(gap, spare)
            spare -= min(gap, spare)
        for column, width in zip(self.columns, widths):
            column.width = width
        try:
            yield from super().__rich_console__(console, options)
        finally:
            for column in self.columns:
                column.width = None

    def records(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The rows as records: the title, then per row its id (the id columns, or the first column) on a line of
        its own, folded only if longer than the console, then ``header  value`` lines for the rest; the caption
        last."""
        columns = self.columns
        heads = [c for c in columns if str(c.header) in self.id_headers] or columns[:1]
        if self.title:
            yield Text(str(self.title), style="bold", overflow="fold")
        cells = [list(c.cells) for c in columns]
        for r in range(self.row_count):
            head = Text(overflow="fold", style="bold")
            for n, column in enumerate(heads):
                cell = cells[columns.index(column)][r]
                head.append(("  " if n else "") + (cell.plain if isinstance(cell, Text) else str(cell)))
            yield head
            grid = Table.grid(padding=(0, 2))
            grid.add_column(overflow="fold")
            grid.add_column(overflow="fold")
            for i, column in enumerate(columns):
                if column not in heads:
                    grid.add_row(Text("  ") + Text(str(column.header)), cells[i][r])
            yield grid
        if self.caption:  # e.g. capacity's "prices: ... examples only": a narrow terminal must not lose it
            yield Text(str(self.caption), style="dim", overflow="fold")


def add_id_column(table: Table, header: str) -> None:
    """A column of ids: left-justified, never wrapped, ellipsised or cropped (an :class:`IdTable` keeps
    it whole or heads a record with it; on a plain ``Table`` it folds when wider than the column)."""
    table.add_column(header, justify="left", overflow="fold")
    if isinstance(table, IdTable):
        table.id_headers.add(header)


def add_text_column(table: Table, header: str) -> None:
    """A column of prose or lists: left-justified, wraps at spaces, folds a word wider than the column."""
    table.add_column(header, justify="left", overflow="fold")


def add_number_column(table: Table, header: str) -> None:
    """A column of figures: right-justified, folds (never cuts) a figure wider than the column."""
    table.add_column(header, justify="right", overflow="fold")


def new_table(title: str | None, columns: Sequence[str], *, ids: Collection[str] = (),
              text: Collection[str] = ()) -> IdTable:
    """A ``rich`` table with ``columns`` in order: those in ``ids`` as id columns (:func:`add_id_column`),
    those in ``text`` as text columns (:func:`add_text_column`), the rest numeric (:func:`add_number_column`).

    Too wide for the console, the table shrinks its wrapping columns first (headers and figures wrap
    or fold); an id column keeps its width unless nothing else can give, and then folds, never cuts.

    Raises:
        ValueError: a name in ``ids`` or ``text`` is not among ``columns``, or is in both.
    """
    unknown = (set(ids) | set(text)) - set(columns)
    if unknown:
        raise ValueError(f"new_table: {sorted(unknown)} not among the columns {list(columns)}")
    if set(ids) & set(text):
        raise ValueError(f"new_table: {sorted(set(ids) & set(text))} named both id and text")
    table = IdTable(title=title)
    for name in columns:
        if name in ids:
            add_id_column(table, name)
        elif name in text:
            add_text_column(table, name)
        else:
            add_number_column(table, name)
    return table


def plain_console(**kwargs: Any) -> Console:
    """A ``rich`` console that prints text as it is: no markup (``[red]``, ``[link=...]``, a stray ``[/]`` would
    raise) and no emoji codes, since names and sources in tables come from users' files."""
    return Console(markup=False, emoji=False, **kwargs)


def cli_console() -> Console:
    """The console a command prints its tables to: the terminal's width on a terminal; on a pipe or a
    file ``COLUMNS`` if set, else :data:`PIPE_WIDTH` (rich's default of 80 would fold needlessly)."""
    stream = sys.stdout
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if is_tty or os.environ.get("COLUMNS") else PIPE_WIDTH
    return plain_console(width=width)


def render_text(*renderables: RenderableType, width: int = PIPE_WIDTH) -> str:
    """``renderables`` rendered as plain text (no colour) at ``width`` columns, one after another."""
    buffer = io.StringIO()
    console = plain_console(file=buffer, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    for item in renderables:
        console.print(item)
    return buffer.getvalue().rstrip("\n")
