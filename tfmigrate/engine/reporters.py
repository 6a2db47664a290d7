"""Output formats for `check`: text (rich), json (ruff's shape), github, sarif, statistics."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import TYPE_CHECKING, Iterable, TextIO

from tfmigrate import __version__
from tfmigrate.findings import Finding, FixSafety
from tfmigrate.engine.registry import all_rules, info_by_code
from tfmigrate.engine.source import split_lines

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

DOCS_URL = "https://github.com/tfmigrate/tfmigrate/blob/main/docs/rules.md#{code}"
FORMATS = ("text", "json", "github", "sarif")


def rule_url(code: str) -> str:
    return DOCS_URL.format(code=code.lower())


def _source_line(f: Finding, cache: dict) -> str | None:
    """The line a finding starts on; ``cache`` maps a path (or (path, cell)) to its lines."""
    key = f.path if f.cell is None else (f.path, f.cell)
    if key not in cache and f.cell is not None:
        from tfmigrate.engine.notebook import cell_lines

        for number, lines in cell_lines(f.path).items():
            cache.setdefault((f.path, number), lines)
        cache.setdefault(key, [])
    if key not in cache:
        try:
            with open(f.path, "rb") as handle:
                cache[key] = split_lines(handle.read().decode("utf-8", errors="replace"))
        except OSError:
            cache[key] = []
    lines = cache[key]
    return lines[f.start.row - 1] if 0 < f.start.row <= len(lines) else None


def _marker(finding: Finding) -> str:
    if finding.fix_title is None:
        return ""
    return " [*]" if finding.fix_safety == FixSafety.SAFE else " [*unsafe]"


class PlainConsole:
    """The part of rich's ``Console`` the text report and the one-line messages use, for a
    stream rich would not style (see :func:`plain_stream`): the characters are written as they
    are (less the control codes rich strips), and rich is not even imported, a tenth of a
    warm run."""

    is_terminal = False
    color_system = None
    is_jupyter = False
    record = False
    soft_wrap = True

    def __init__(self, file) -> None:
        self.file = file

    def print(self, text: str = "", **options) -> None:
        self.file.write(str(text).translate(_RICH_STRIPS) + "\n")


_RICH_STRIPS = dict.fromkeys([7, 8, 11, 12, 13])  # bell, backspace, vertical tab, form feed, carriage return
# What makes rich style a stream that is not a terminal (rich's Console.is_terminal).
_STYLING_VARIABLES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def no_color() -> bool:
    """``NO_COLOR`` set (to anything but nothing, https://no-color.org): no escape code is
    written anywhere, on a terminal or not (no colour, no bold, no progress bar)."""
    return bool(os.environ.get("NO_COLOR"))


def plain_stream(stream) -> bool:
    """Whether rich would print to ``stream`` without any styling: not a terminal, no
    variable forcing colour, not in Jupyter; or ``NO_COLOR`` (see :func:`no_color`)."""
    import builtins

    if no_color():
        return True
    if any(name in os.environ for name in _STYLING_VARIABLES) or hasattr(builtins, "get_ipython"):
        return False
    try:
        return not stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


# A character that rich does not print as itself: tabs (expanded) and control codes (stripped).
_NOT_PLAIN = re.compile(r"[\x00-\x1f\x7f]")


class _Printer:
    """Prints lines made of styled parts. On a console that does no styling (not a terminal,
    no colour: a pipe, a file, CI) the parts' characters are written directly: rich's
    rendering costs ~0.3 ms a line, most of a warm run over a thousand findings. Elsewhere the
    parts go to rich as a ``Text`` (never as markup: source lines hold brackets and
    backslashes, which rich's markup escaping does not always give back as they were)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.plain = (
            not console.is_terminal and console.color_system is None and not console.is_jupyter
            and not console.record and console.soft_wrap
        )
        self.wrote = False
        self.write = console.file.write

    def __call__(self, *parts: tuple[str, str | None]) -> None:
        if self.plain:
            line = "".join([text for text, _ in parts])
            if not _NOT_PLAIN.search(line):
                self.write(line + "\n")
                self.wrote = True
                return
        from rich.text import Text

        self.flush()
        self.console.print(Text.assemble(*parts), highlight=False)

    def flush(self) -> None:
        if self.wrote:
            self.console.file.flush()
            self.wrote = False


def render_text(
    findings: list[Finding], errors: list[tuple[str, str]], console: Console, *, show_source: bool = True,
    lines_of: dict | None = None,
) -> None:
    """``lines_of`` supplies the lines of sources not on disk as plain text (notebook cells)."""
    out = _Printer(console)
    cache: dict = dict(lines_of or {})
    for f in findings:
        where = f"{f.path}:{'cell ' + str(f.cell) + ':' if f.cell else ''}{f.start.row}:{f.start.column}"
        style = "cyan" if f.informational else "bold red"
        out((where, "bold"), (": ", None), (f.code, style), (_marker(f) + " " + f.message, None))
        if not show_source:
            continue
        line = _source_line(f, cache)
        if line is None:
            continue
        gutter = str(f.start.row)
        # Keep tabs in the padding so the marker lines up under the same characters.
        before = line[: f.start.column - 1]
        padding = "".join(c if c == "\t" else " " for c in before) if "\t" in before else " " * len(before)
        width = (f.end.column - f.start.column) if f.end.row == f.start.row else len(line) - f.start.column + 1
        blank = " " * len(gutter)
        out((f"{blank} |", "blue"))
        out((f"{gutter} |", "blue"), (" " + line, None))
        out((f"{blank} |", "blue"), (" " + padding, None), ("^" * max(1, width), style))
        out()
    out.flush()
    for path, message in errors:
        out((path, "bold"), (": ", None), ("error", "bold red"), (": " + message, None))
    out.flush()


def summary_line(findings: list[Finding], errors: list[tuple[str, str]], files: int) -> str:
    counted = [f for f in findings if not f.informational]
    info = len(findings) - len(counted)
    if not findings and not errors:
        return f"All checks passed ({files} file{'s' if files != 1 else ''} checked)."
    parts = []
    if findings:
        safe = sum(1 for f in findings if f.fixable and f.fix_safety == FixSafety.SAFE)
        unsafe = sum(1 for f in findings if f.fixable and f.fix_safety == FixSafety.UNSAFE)
        text = f"Found {len(counted)} finding{'s' if len(counted) != 1 else ''}"
        if info:
            text += f" and {info} note{'s' if info != 1 else ''}"
        text += f" ({files} file{'s' if files != 1 else ''} checked)."
        parts.append(text)
        if safe:
            parts.append(f"[*] {safe} fixable with `tfmigrate fix --write`.")
        if unsafe:
            parts.append(f"{unsafe} {'more ' if safe else ''}fixable with `tfmigrate fix --write --unsafe-fixes`.")
    if errors:
        parts.append(f"{len(errors)} file{'s' if len(errors) != 1 else ''} could not be checked.")
    return " ".join(parts)


# Where a per-file error's message says the problem is: "syntax error at line 3, column 7",
# "print statement at line 3", "cannot decode as utf-8 (line 3, byte 0xff)".
_ERROR_AT = re.compile(r"\bline (?P<row>\d+)(?:, column (?P<column>\d+))?")


def error_location(message: str) -> tuple[int, int]:
    """(row, column) of a per-file error, from its message; (1, 1) when it names no line."""
    match = _ERROR_AT.search(message)
    if match is None:
        return 1, 1
    return int(match.group("row")), int(match.group("column") or 1)


def _location(row: int, column: int) -> dict:
    return {"column": column, "row": row}


def json_findings(findings: list[Finding], errors: list[tuple[str, str]]) -> list[dict]:
    """ruff's JSON shape, so tools that read ruff's output read ours."""
    out = []
    for f in findings:
        out.append({
            "cell": f.cell,
            "code": f.code,
            "name": f.name,
            "message": f.message,
            "filename": os.path.abspath(f.path),
            "location": _location(f.start.row, f.start.column),
            "end_location": _location(f.end.row, f.end.column),
            "fix": None if f.fix_title is None else {
                "applicability": f.fix_safety.value,
                "message": f.fix_title,
            },
            "noqa_row": f.start.row,
            "url": rule_url(f.code),
            "severity": "info" if f.informational else "error",
        })
    for path, message in errors:
        where = _location(*error_location(message))
        out.append({
            "cell": None, "code": None, "name": "error", "message": message,
            "filename": os.path.abspath(path), "location": where, "end_location": where,
            "fix": None, "noqa_row": None, "url": None, "severity": "error",
        })
    return out


def _github_escape(text: str, property_value: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if property_value:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def github_lines(findings: list[Finding], errors: list[tuple[str, str]]) -> Iterable[str]:
    for f in findings:
        level = "notice" if f.informational else "error"
        props = (
            f"title={_github_escape('tfmigrate (' + f.code + ')', True)},file={_github_escape(f.path, True)},"
            f"line={f.start.row},col={f.start.column},endLine={f.end.row},endColumn={f.end.column}"
        )
        yield f"::{level} {props}::{_github_escape(f.code + ' ' + f.message)}"
    for path, message in errors:
        row, column = error_location(message)
        yield f"::error title=tfmigrate,file={_github_escape(path, True)},line={row},col={column}::{_github_escape(message)}"


def sarif_document(findings: list[Finding], errors: list[tuple[str, str]]) -> dict:
    rules = list(all_rules())
    index = {rule.code: i for i, rule in enumerate(rules)}
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "tfmigrate",
                "version": __version__,
                "informationUri": "https://github.com/tfmigrate/tfmigrate",
                "rules": [{
                    "id": rule.code,
                    "name": rule.name,
                    "shortDescription": {"text": rule.summary},
                    "fullDescription": {"text": " ".join(rule.what_it_finds.split())},
                    "help": {"text": rule.summary, "markdown": rule.documentation()},
                    "helpUri": rule_url(rule.code),
                    "defaultConfiguration": {"level": "note" if rule.informational else "error"},
                    "properties": {"fixSafety": rule.fix_safety.value},
                } for rule in rules],
            }},
            "results": [{
                "ruleId": f.code,
                "ruleIndex": index.get(f.code, -1),
                "level": "note" if f.informational else "error",
                "message": {"text": f.message},
                "locations": [{"physicalLocation": {
                    "artifactLocation": {"uri": f.path.replace(os.sep, "/")},
                    "region": {
                        "startLine": f.start.row, "startColumn": f.start.column,
                        "endLine": f.end.row, "endColumn": f.end.column,
                    },
                }}],
            } for f in findings],
            "invocations": [{
                "executionSuccessful": not errors,
                "toolExecutionNotifications": [{
                    "level": "error",
                    "message": {"text": message},
                    "locations": [{"physicalLocation": {
                        "artifactLocation": {"uri": path.replace(os.sep, "/")},
                        "region": dict(zip(("startLine", "startColumn"), error_location(message))),
                    }}],
                } for path, message in errors],
            }],
        }],
    }


def write_machine(fmt: str, findings: list[Finding], errors: list[tuple[str, str]], stream: TextIO) -> None:
    if fmt == "json":
        json.dump(json_findings(findings, errors), stream, indent=2)
        stream.write("\n")
    elif fmt == "github":
        for line in github_lines(findings, errors):
            stream.write(line + "\n")
    elif fmt == "sarif":
        json.dump(sarif_document(findings, errors), stream, indent=2)
        stream.write("\n")
    else:  # pragma: no cover - guarded by the CLI
        raise ValueError(fmt)


def statistics_table(findings: list[Finding]) -> Table:
    from rich.table import Table

    counts = Counter(f.code for f in findings)
    fixable = Counter(f.code for f in findings if f.fixable)
    table = Table(box=None, show_header=True, header_style="bold")
    table.add_column("count", justify="right")
    table.add_column("code")
    table.add_column("name")
    table.add_column("fixable")
    for code, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        rule = info_by_code(code)
        table.add_row(str(count), code, rule.name if rule else "", str(fixable[code]) if fixable[code] else "")
    return table
