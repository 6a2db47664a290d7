"""What `check` reports, as plain data: no LibCST here.

A cache hit, a file the prefilter skips and every output format need only these classes, so
they live apart from :mod:`tfmigrate.rule` (which imports LibCST, a few hundred milliseconds
of start-up). ``tfmigrate.rule`` re-exports them: rules import them from there.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field


class FixSafety(str, enum.Enum):
    SAFE = "safe"  # applied by `fix`
    UNSAFE = "unsafe"  # applied only with --unsafe-fixes; check the result with `verify`
    NONE = "none"  # the message says what to do by hand


# Rules end a finding's message with the reason its fix was refused (see Finding.refusal).
_REFUSAL = re.compile(r"no automatic fix: (.*?)\)?$", re.S)


@dataclass(frozen=True)
class Location:
    row: int
    column: int  # 1-based, like ruff's JSON


@dataclass
class Finding:
    code: str
    name: str
    message: str
    path: str
    start: Location
    end: Location
    fix_safety: FixSafety  # what fixing this finding needs: safe, unsafe, or none (by hand)
    fix_title: str | None = None  # set when a fix is available for this occurrence
    informational: bool = False
    cell: int | None = None  # notebook cell (1-based) when the file is a notebook
    url: str | None = None

    @property
    def fixable(self) -> bool:
        return self.fix_title is not None

    @property
    def refusal(self) -> str | None:
        """Why the fix left this finding, when the rule said (`... (no automatic fix: <why>)`)."""
        if self.fixable:
            return None
        match = _REFUSAL.search(self.message)
        return match.group(1) if match else None

    def sort_key(self) -> tuple:
        return (self.path, self.cell or 0, self.start.row, self.start.column, self.code)


@dataclass
class FileResult:
    """What checking one file gave: plain data, sent back from worker processes and cached."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    parsed: bool = False  # False when the prefilter showed no rule could fire
    notes: list[str] = field(default_factory=list)  # said on stderr; not errors (a skipped notebook cell)
    digest: str | None = None  # hash of the bytes checked (the cache key)
    cacheable: bool = True  # False when the result also depends on other files the rules read
