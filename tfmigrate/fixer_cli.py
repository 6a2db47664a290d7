"""`tfmigrate fix`: preview (a unified diff) by default, ``--write`` to apply."""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, List, Optional

import typer

from tfmigrate.config import ConfigError
from tfmigrate.discovery import discover
from tfmigrate.findings import FixSafety

if TYPE_CHECKING:
    from tfmigrate.fixer import FixResult

# Why a file was skipped, from its one-line error (the summary counts files per reason).
_REASONS = [
    ("read-only", "read-only"),
    ("changed while", "changed on disk"),
    ("deleted while", "deleted on disk"),
    ("could not write", "could not write"),
    ("Python 2 syntax", "Python 2 syntax"),
    ("syntax error", "syntax error"),
    ("cannot decode", "cannot decode"),
    ("NUL bytes", "cannot decode"),
    ("LibCST does not reproduce", "not reproducible by LibCST"),
    ("LibCST cannot parse", "not parsable by LibCST"),
    ("not a regular file", "not a regular file"),
    ("permission denied", "cannot read"),
    ("internal error", "internal error"),
    ("no such file", "not found"),
]


def skip_reason(message: str) -> str:
    return next((reason for needle, reason in _REASONS if needle in message), "other error")


def _summary(results: list[FixResult], missing: list[str], write: bool, unsafe: bool) -> list[str]:
    ok = [r for r in results if not r.error]
    fixed = sum(len(r.fixed) for r in ok)
    changed = [r for r in ok if r.changed]
    remaining = [f for r in ok for f in r.remaining if not f.informational]
    why = Counter(
        "need --unsafe-fixes" if f.fixable and f.fix_safety == FixSafety.UNSAFE and not unsafe else "have no automatic fix"
        for f in remaining
    )
    verb = "Fixed" if write else "Would fix"
    files = f"{len(changed)} file{'s' if len(changed) != 1 else ''}"
    lines = [f"{verb} {fixed} finding{'s' if fixed != 1 else ''} in {files}."]
    if remaining:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(why.items()))
        lines.append(f"{len(remaining)} remain ({reasons}); see `tfmigrate check`.")
    skipped = Counter(skip_reason(r.error) for r in results if r.error)
    skipped.update("not found" for _ in missing)
    skipped.update("symlink outside the paths given" for r in ok if r.skipped)
    if skipped:
        total = sum(skipped.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        lines.append(f"{total} file{'s' if total != 1 else ''} skipped ({reasons}); see the messages above.")
    return lines


def refusal_lines(results: list[FixResult]) -> list[str]:
    """`path:row:col: CODE no automatic fix: <why>` for each finding a rule refused to rewrite."""
    lines = []
    for result in results:
        for finding in result.remaining if not result.error else ():
            if finding.refusal:
                where = f"{finding.path}:{finding.start.row}:{finding.start.column}"
                lines.append(f"{where}: {finding.code} no automatic fix: {finding.refusal}")
    return lines


def register(app: typer.Typer) -> None:
    from tfmigrate.cli import (
        EXIT_CLEAN, EXIT_ERROR, EXIT_FINDINGS, ConfigOpt, ForceExcludeOpt, IgnoreOpt, JobsOpt, PathsArg,
        SelectOpt, stderr_console, build_config, print_notes, run_files,
    )

    @app.command()
    def fix(
        paths: Optional[List[str]] = PathsArg,
        write: bool = typer.Option(False, "--write", "-w", help="Apply the fixes (default: only show the diff)."),
        diff: bool = typer.Option(False, "--diff", help="Show the diff and change nothing (the default)."),
        unsafe_fixes: bool = typer.Option(False, "--unsafe-fixes", help="Also apply unsafe (structural) fixes."),
        select: Optional[List[str]] = SelectOpt,
        ignore: Optional[List[str]] = IgnoreOpt,
        target: Optional[str] = typer.Option(None, "--target", help="Migration target: compat (default) or tf2."),
        exit_non_zero_on_fix: bool = typer.Option(
            False, "--exit-non-zero-on-fix", help="Exit 1 when a file was rewritten (for pre-commit)."
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print errors only."),
        show_refusals: Optional[bool] = typer.Option(
            None, "--show-refusals/--hide-refusals",
            help="Print why each remaining finding got no fix (default: with --unsafe-fixes).",
        ),
        config_file: Optional[str] = ConfigOpt,
        force_exclude: bool = ForceExcludeOpt,
        jobs: Optional[int] = JobsOpt,
    ) -> None:
        """Rewrite legacy patterns to tf.distribute / tf.data (a diff unless --write)."""
        paths = paths or ["."]
        err = stderr_console()
        if write and diff:
            err.print("error: --write and --diff exclude each other", highlight=False, markup=False)
            raise typer.Exit(EXIT_ERROR)
        try:
            config = build_config(paths, select, ignore, config_file, target)
        except ConfigError as exc:
            err.print(f"error: {exc}", highlight=False, markup=False)
            raise typer.Exit(EXIT_ERROR)
        found = discover(paths, config, force_exclude=force_exclude)
        # A file reached through two paths (or a link and its target) is fixed once.
        files, seen = [], set()
        for path in found.files:
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                files.append(path)

        if write:  # temporary files a killed earlier run left behind (see RELIABILITY.md)
            from tfmigrate.source import remove_stale_temp_files

            for folder in sorted({os.path.dirname(os.path.realpath(path)) for path in files}):
                remove_stale_temp_files(folder)
        within = tuple(os.path.realpath(path) for path in paths)  # a link out of these is not fixed
        from tfmigrate.fixer import fix_file  # LibCST and the rules: only when there is something to fix

        # picklable, for the workers
        work = functools.partial(fix_file, unsafe=unsafe_fixes, write=write, within=within)
        results: list[FixResult] = run_files(files, config, work, quiet=quiet, label="Fixing", jobs=jobs)
        if not quiet:
            print_notes(results, err)
        for path in found.missing:
            err.print(f"{path}: error: no such file or directory", highlight=False, markup=False)
        for result in results:
            if result.error:
                err.print(f"{result.path}: error: {result.error}", highlight=False, markup=False)
            elif result.skipped:
                err.print(f"{result.path}: note: {result.skipped}", highlight=False, markup=False)
            elif not write and result.changed and not quiet:
                sys.stdout.write(result.diff())
        if not quiet and (show_refusals if show_refusals is not None else unsafe_fixes):
            for line in refusal_lines(results):
                err.print(line, highlight=False, markup=False)
        if not quiet:
            for line in _summary(results, found.missing, write, unsafe_fixes):
                err.print(line, highlight=False, markup=False)
        if found.missing or any(r.error for r in results):
            raise typer.Exit(EXIT_ERROR)
        remaining = any(not f.informational for r in results for f in r.remaining)
        if not write:
            raise typer.Exit(EXIT_FINDINGS if any(r.changed for r in results) or remaining else EXIT_CLEAN)
        if remaining or (exit_non_zero_on_fix and any(r.written for r in results)):
            raise typer.Exit(EXIT_FINDINGS)
        raise typer.Exit(EXIT_CLEAN)
