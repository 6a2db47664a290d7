"""The text report: what a pipe receives is what a terminal shows, character for character."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tfmigrate.findings import Finding, FixSafety, Location
from tfmigrate.engine.reporters import PlainConsole, plain_stream, render_text

# Source lines rich's markup escaping did not give back as they were (a trailing backslash was
# doubled, `\[` lost its backslash), brackets, emoji-like codes, a message with markup-like text.
LINES = [
    "x = tf.concat([a, b], axis=0) + \\",
    "path = 'C:\\[data]\\' + name",
    "with tf.device(devices[i]):  # [gpu] :smile: [/]",
    "print('[bold]not markup[/bold]')",
    "y = 1",
]


def _finding(path: str, row: int, column: int, end_column: int, message: str) -> Finding:
    return Finding(
        code="TFM101", name="manual-tower-loop", message=message, path=path,
        start=Location(row, column), end=Location(row, end_column), fix_safety=FixSafety.UNSAFE,
        fix_title="Rewrite", cell=None,
    )


def _render(path: str, console: Console) -> str:
    findings = [
        _finding(path, row, 1, 6, f"message [red]{row}[/red] :smile: \\") for row in range(1, len(LINES) + 1)
    ]
    render_text(findings, [(path, "a [syntax] error \\")], console)
    return console.file.getvalue()


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "legacy[1].py"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return str(path)


def test_pipe_output_is_what_a_terminal_shows(source):
    piped = Console(file=io.StringIO(), soft_wrap=True, color_system=None)
    terminal = Console(file=io.StringIO(), soft_wrap=True, color_system=None, force_terminal=True)
    assert not piped.is_terminal and terminal.is_terminal
    assert _render(source, piped) == _render(source, terminal)


def test_source_lines_and_messages_are_printed_as_they_are(source):
    output = _render(source, Console(file=io.StringIO(), soft_wrap=True, color_system=None, force_terminal=True))
    for line in LINES:
        assert f" | {line}\n" in output
    assert f"{source}:1:1: TFM101 [*unsafe] message [red]1[/red] :smile: \\\n" in output
    assert f"{source}: error: a [syntax] error \\\n" in output


def test_without_rich_a_pipe_gets_the_same_characters(source):
    piped = Console(file=io.StringIO(), soft_wrap=True, color_system=None)
    assert _render(source, PlainConsole(io.StringIO())) == _render(source, piped)


def test_rich_is_used_where_it_would_style(monkeypatch):
    class Stream(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    assert plain_stream(Stream(False)) and not plain_stream(Stream(True))
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not plain_stream(Stream(False))
