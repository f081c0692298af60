"""What the CLI shows people: the one place it makes ``rich`` objects.

On a terminal, output is rich's: a progress bar redrawn in place, tables with a bold
header, a view that refreshes in place. Anywhere else (a pipe, a log file, CI, ``TERM=dumb``)
it is plain text a script or a log reader can take: no colour, no control codes, no
redraws; a progress bar becomes one line every few seconds, a table aligned columns,
a live view one block of lines per update (like ``vmstat``). The choice is made once
per stream by :func:`is_terminal`, never by rich's own guess (so ``FORCE_COLOR`` in a
CI job does not turn a log file into escape codes), and plain text never goes through
rich (so a ``[`` in a path is not markup and a long line is not wrapped at 80 columns).

    is_terminal(stream)                  the decision: a tty whose TERM is not "dumb"
    console(stream)                      a rich Console on stdout (or the stream given)
    progress_bar(stream, every)          ProgressBar: update(description, done, total,
                                         detail), close(); a rich Progress on a terminal,
                                         else one line per ``every`` s and per description
    Table(headers, right)                rows of strings; .lines() plain, .renderable() rich
    print_table(table, stream)           one of the two, by the stream
    group(*parts)                        renderables and plain strings stacked, for LiveView
    LiveView(stream)                     show(renderable, lines): redraws in place on a
                                         terminal, else prints ``lines`` once per call

Strings are ready-formatted by the caller (the units are the caller's): this module
only lays them out.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

PLAIN_EVERY = 5.0       # s between two plain progress lines of the same description


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stdout) is an interactive terminal worth redrawing."""
    stream = stream or sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):     # a closed or fake stream
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


def console(stream: TextIO | None = None) -> Console:
    """A rich Console on ``stream`` (default stdout) that agrees with :func:`is_terminal`:
    colour and cursor control only when it is a terminal (``NO_COLOR`` is honoured)."""
    from rich.console import Console

    stream = stream or sys.stdout
    tty = is_terminal(stream)
    return Console(file=stream, force_terminal=tty, highlight=False, soft_wrap=not tty)


# -- progress ----------------------------------------------------------------------------

class ProgressBar:
    """One task's progress: ``update(description, done, total, detail)`` as often as you
    like, ``close()`` once (or use it as a context manager). Nothing is drawn before the
    first update.

    ``total=None`` means not known yet (a scan): the bar pulses and no % is shown.
    ``detail`` is the caller's text after the bar (rates, ETA). Plain mode prints
    ``description: pct%  detail`` when the description changes and at most every
    ``every`` s otherwise; the last update of a description is printed too (before the
    next description's first, or by ``close()``)."""

    def __init__(self, stream: TextIO | None = None, every: float = PLAIN_EVERY) -> None:
        self.stream = stream or sys.stderr
        self.every = every
        self.tty = is_terminal(self.stream)
        self._progress: Any = None
        self._task: Any = None
        self._last = -float("inf")
        self._description: str | None = None
        self._pending: str | None = None     # plain: the newest line not yet printed

    def update(self, description: str, done: float, total: float | None, detail: str = "") -> None:
        if self.tty:
            if self._progress is None:        # started by the first update: a quiet run draws nothing
                self._start()
            self._progress.update(self._task, description=description, completed=done,
                                  total=total, detail=detail)
            return
        pct = f"{100 * done / total:5.1f}%  " if total else ("100.0%  " if total == 0 else "")
        line = f"{description}: {pct}{detail}".rstrip()
        now = time.monotonic()
        if description != self._description and self._pending is not None:
            self._write(self._pending)        # how the previous description ended
        if description != self._description or now - self._last >= self.every:
            self._write(line)
            self._last, self._description, self._pending = now, description, None
        else:
            self._pending = line

    def _start(self) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

        self._progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                  TaskProgressColumn(),
                                  TextColumn("{task.fields[detail]}", markup=False),
                                  console=console(self.stream), refresh_per_second=10)
        self._task = self._progress.add_task("", total=None, detail="")
        self._progress.start()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def progress_bar(stream: TextIO | None = None, every: float = PLAIN_EVERY) -> ProgressBar:
    """A :class:`ProgressBar` on ``stream`` (default stderr: progress is not output)."""
    return ProgressBar(stream, every)


# -- tables ------------------------------------------------------------------------------

class Table:
    """Rows of ready-formatted strings under a header line.

    ``right``: the columns (by index) aligned right, numbers usually. :meth:`lines` is
    the plain form: columns two spaces apart, each as wide as its widest cell (or
    ``widths``, for a header printed once above rows that come later, as vmstat does),
    no trailing spaces. :meth:`renderable` is a rich Table for a terminal."""

    def __init__(self, headers: Sequence[str], right: Sequence[int] = (),
                 title: str | None = None) -> None:
        self.headers = list(headers)
        self.right = set(right)
        self.title = title
        self.rows: list[list[str]] = []

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"a row of {len(cells)} cells under {len(self.headers)} headers")
        self.rows.append([str(c) for c in cells])

    def widths(self) -> list[int]:
        return [max(len(r[i]) for r in [self.headers, *self.rows]) for i in range(len(self.headers))]

    def lines(self, header: bool = True, widths: Sequence[int] | None = None) -> list[str]:
        w = list(widths) if widths is not None else self.widths()
        out = [] if self.title is None or not header else [self.title]
        for row in ([self.headers] if header else []) + self.rows:
            cells = [c.rjust(w[i]) if i in self.right else c.ljust(w[i]) for i, c in enumerate(row)]
            out.append("  ".join(cells).rstrip())
        return out

    def renderable(self) -> RenderableType:
        from rich import box
        from rich.table import Table as RichTable

        t = RichTable(title=self.title, title_justify="left", box=box.SIMPLE_HEAD,
                      header_style="bold", pad_edge=False)
        for i, h in enumerate(self.headers):
            t.add_column(h, justify="right" if i in self.right else "left", overflow="fold")
        for row in self.rows:
            t.add_row(*row)
        return t


def print_table(table: Table, stream: TextIO | None = None) -> None:
    """``table`` on ``stream`` (default stdout): rich on a terminal, plain lines otherwise."""
    stream = stream or sys.stdout
    if is_terminal(stream):
        console(stream).print(table.renderable())
    else:
        stream.write("".join(line + "\n" for line in table.lines()))
        stream.flush()


def group(*parts: RenderableType | str) -> RenderableType:
    """Several renderables (or plain strings, never read as markup) one under the other."""
    from rich.console import Group
    from rich.text import Text

    return Group(*(Text(p) if isinstance(p, str) else p for p in parts))


# -- a view that refreshes ---------------------------------------------------------------

class LiveView:
    """A display updated in place on a terminal (rich ``Live``), and a stream of plain
    lines elsewhere: each :meth:`show` gives both forms and the stream picks one."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = is_terminal(self.stream)
        self._live: Any = None
        if self.tty:
            from rich.live import Live

            self._live = Live(console=console(self.stream), auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def show(self, renderable: RenderableType, lines: Sequence[str]) -> None:
        if self._live is not None:
            self._live.update(renderable, refresh=True)
        else:
            self.stream.write("".join(line + "\n" for line in lines))
            self.stream.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
