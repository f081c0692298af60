"""``cli/terminal.py``: plain output when the stream is not a terminal (no colour, no
control codes, no redraws, no wrapping, no markup), rich output on a real pty."""
from __future__ import annotations

import io
import os
import select

import pytest

from kspeedfs.cli import terminal
from kspeedfs.cli.terminal import LiveView, ProgressBar, Table, is_terminal, print_table


def assert_plain(text: str) -> None:
    assert "\x1b" not in text and "\r" not in text, repr(text)


def test_a_pipe_is_plain_even_when_the_environment_forces_colour(monkeypatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    out = io.StringIO()
    assert not is_terminal(out)
    assert not terminal.console(out).is_terminal


def test_progress_prints_one_line_per_description_and_per_interval() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, every=3600)
    bar.update("scanning", 10, None, "10 entries")
    bar.update("scanning", 20, None, "20 entries")            # within the interval: held back
    for done in range(0, 1001, 100):
        bar.update("hash", done, 1000, f"{done} bytes")
    bar.close()                                                # the last update is printed
    assert out.getvalue().splitlines() == [
        "scanning: 10 entries", "scanning: 20 entries",    # how the scan ended
        "hash:   0.0%  0 bytes", "hash: 100.0%  1000 bytes"]
    assert_plain(out.getvalue())


def test_progress_prints_again_after_its_interval(monkeypatch) -> None:
    clock = iter([0.0, 1.0, 6.0])
    monkeypatch.setattr(terminal.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with ProgressBar(out, every=5.0) as bar:
        for done in (1, 2, 3):
            bar.update("hash", done, 4)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["25.0%", "75.0%"]


def test_a_quiet_progress_bar_prints_nothing() -> None:
    out = io.StringIO()
    ProgressBar(out).close()
    assert out.getvalue() == ""


def test_plain_table_aligns_columns_without_markup_or_wrapping() -> None:
    t = Table(["NAME", "FILES", "SOURCE"], right=[1])
    t.add("imagenet", "1,281,167", "/nfs/[train]/" + "x" * 120)
    t.add("a", 7, "/b")
    out = io.StringIO()
    print_table(t, out)
    lines = out.getvalue().splitlines()
    assert lines == ["NAME          FILES  SOURCE",
                     "imagenet  1,281,167  /nfs/[train]/" + "x" * 120,
                     "a                 7  /b"]
    assert_plain(out.getvalue())


def test_table_rows_must_match_the_header() -> None:
    with pytest.raises(ValueError):
        Table(["A", "B"]).add("only one")


def test_plain_live_view_prints_each_update_once() -> None:
    out = io.StringIO()
    with LiveView(out) as view:
        view.show(terminal.group("ignored on a pipe"), ["  r/s  MB/s", "  1.0  2.0"])
        view.show(terminal.group("ignored on a pipe"), ["  3.0  4.0"])
    assert out.getvalue() == "  r/s  MB/s\n  1.0  2.0\n  3.0  4.0\n"


@pytest.fixture
def pty(monkeypatch):
    """A real terminal: the slave end as a text stream, and a reader of the master end."""
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    master, slave = os.openpty()
    stream = open(slave, "w", encoding="utf-8", closefd=True)

    def read() -> str:
        stream.flush()
        chunks = []
        while select.select([master], [], [], 0.2)[0]:
            chunks.append(os.read(master, 65536))
        return b"".join(chunks).decode(errors="replace")

    yield stream, read
    stream.close()
    os.close(master)


def test_a_terminal_gets_rich_output_unless_term_is_dumb(pty, monkeypatch) -> None:
    stream, read = pty
    assert is_terminal(stream)
    t = Table(["NAME", "FILES"], right=[1])
    t.add("imagenet", "3")
    print_table(t, stream)
    assert "\x1b[" in read()                       # the bold header
    monkeypatch.setenv("TERM", "dumb")
    assert not is_terminal(stream)
    print_table(t, stream)
    text = read()
    assert "imagenet" in text
    assert "\x1b" not in text
