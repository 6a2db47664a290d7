"""`tfmigrate fix`: preview (a unified diff) by default, ``--write`` to apply."""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, List, Optional

import typer

from tfmigrate.engine.config import ConfigError
from tfmigrate.engine.source import SourceError
from tfmigrate.engine.discovery import discover
from tfmigrate.findings import FixSafety

if TYPE_CHECKING:
    from tfmigrate.engine.fixer import FixResult

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
    ("too deeply nested", "too deeply nested"),
    ("process fixing it died", "worker process crashed"),
    ("internal error", "internal error"),
    ("no such file", "not found"),
]


def skip_reason(message: str) -> str:
    return next((reason for needle, reason in _REASONS if needle in message), "other error")


def _summary(
    results: list[FixResult], missing: list[str], write: bool, unsafe: bool, walk_skipped: list = (),
) -> list[str]:
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
    skipped.update("symlink loop" if "symlink loop" in why else "cannot read folder" for _, why in walk_skipped)
    if skipped:
        total = sum(skipped.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        lines.append(f"{total} file{'s' if total != 1 else ''} skipped ({reasons}); see the messages above.")
    return lines


def reported(result: FixResult, written: bool) -> list:
    """The findings left in a file, where the user will find them: in the fixed text when it
    was written (or printed), else in the file as it is."""
    if written or result.remaining_before is None:
        return result.remaining
    return result.remaining_before


def refusal_lines(results: list[FixResult], written: bool = True) -> list[str]:
    """`path:row:col: CODE no automatic fix: <why>` for each finding a rule refused to rewrite."""
    lines = []
    for result in results:
        for finding in reported(result, written) if not result.error else ():
            if finding.refusal:
                where = f"{finding.path}:{finding.start.row}:{finding.start.column}"
                lines.append(f"{where}: {finding.code} no automatic fix: {finding.refusal}")
    return lines


def _unique(files: list[str]) -> list[str]:
    """A file reached through two paths (or a link and its target) is fixed once."""
    unique, seen = [], set()
    for path in files:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def _fix_stdin(name: str, config, unsafe: bool, force_exclude: bool) -> list[FixResult]:
    """`fix -`: the fixed code (the input itself when there is nothing to fix, or it cannot be
    fixed) goes to stdout, as ruff does; messages to stderr."""
    from tfmigrate.cli.main import read_stdin
    from tfmigrate.engine.fixer import fix_bytes

    raw, excluded = read_stdin(name, config, force_exclude)
    results = [] if excluded else [fix_bytes(name, raw, config, unsafe=unsafe)]
    data = raw
    if results and results[0].changed and not results[0].error:
        try:
            data = results[0].fixed_bytes()
        except SourceError as exc:
            results[0].error = str(exc)
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return results


def _fix_files(paths: list[str], config, options: dict, err) -> tuple[list[FixResult], list[str], list]:
    """`fix` over files and folders: (results, missing paths, what the walk skipped)."""
    from tfmigrate.cli.main import print_skipped, run_files
    from tfmigrate.engine.workers import Interrupted

    found = discover(paths, config, force_exclude=options["force_exclude"])
    print_skipped(found.skipped, err)
    files = _unique(found.files)
    write = options["write"]
    if write:  # temporary files a killed earlier run left behind (see RELIABILITY.md)
        from tfmigrate.engine.source import remove_stale_temp_files

        for folder in sorted({os.path.dirname(os.path.realpath(path)) for path in files}):
            remove_stale_temp_files(folder)
    within = tuple(os.path.realpath(path) for path in paths)  # a link out of these is not fixed
    from tfmigrate.engine.fixer import FixResult, fix_file  # LibCST and the rules: only when there is something to fix

    # picklable, for the workers
    work = functools.partial(fix_file, unsafe=options["unsafe"], write=write, within=within)
    crashed = lambda path, why: FixResult(path=path, error=f"the process fixing it died ({why}); file left untouched")  # noqa: E731
    try:
        results = run_files(
            files, config, work, quiet=options["quiet"], label="Fixing", jobs=options["jobs"], on_crash=crashed,
        )
    except Interrupted as stop:
        what = "written" if write else "fixed in memory (nothing written)"
        err.print(
            f"Interrupted: {stop.written if write else sum(1 for r in stop.results if r is not None)} "
            f"file(s) {what}; every other file is as it was.", highlight=False, markup=False,
        )
        raise typer.Exit(130)
    return results, found.missing, found.skipped


def _print_results(results: list[FixResult], missing: list[str], options: dict, err) -> None:
    from tfmigrate.cli.main import print_notes, report

    quiet, write = options["quiet"], options["write"]
    if not quiet:
        print_notes(results, err)
    errors = [(path, "no such file or directory") for path in missing]
    errors += [(r.path, r.error) for r in results if r.error]
    for result in results:
        if result.skipped:
            err.print(f"{result.path}: note: {result.skipped}", highlight=False, markup=False)
    if options["output_format"] != "text" or options["statistics"]:
        remaining = sorted(
            (f for r in results if not r.error for f in reported(r, write or options["stdin"])), key=lambda f: f.sort_key(),
        )
        report(
            remaining, errors, output_format=options["output_format"], statistics=options["statistics"], quiet=quiet,
            to_stderr=options["stdin"],
        )
    else:
        from tfmigrate.cli.main import print_errors

        print_errors(errors, err)
        for result in results:
            if not write and not options["stdin"] and not result.error and result.changed and not quiet:
                sys.stdout.write(result.diff())
    if not quiet and (options["show_refusals"] if options["show_refusals"] is not None else options["unsafe"]):
        for line in refusal_lines(results, write or options["stdin"]):
            err.print(line, highlight=False, markup=False)


def _exit_status(results: list[FixResult], missing: list[str], options: dict) -> int:
    from tfmigrate.cli.main import EXIT_CLEAN, EXIT_ERROR, EXIT_FINDINGS

    if options["exit_zero"]:
        return EXIT_CLEAN
    if missing or any(r.error for r in results):
        return EXIT_ERROR
    remaining = any(not f.informational for r in results for f in r.remaining)
    if not options["write"] and not options["stdin"]:
        return EXIT_FINDINGS if any(r.changed for r in results) or remaining else EXIT_CLEAN
    if remaining or (options["exit_non_zero_on_fix"] and any(r.written or (options["stdin"] and r.changed) for r in results)):
        return EXIT_FINDINGS
    return EXIT_CLEAN


def run_fix(paths: Optional[List[str]], options: dict) -> int:
    """`tfmigrate fix`; returns the exit status."""
    from tfmigrate.cli.main import EXIT_ERROR, build_config, stderr_console, stdin_path
    from tfmigrate.engine.reporters import FORMATS

    err = stderr_console()
    if options["write"] and options["diff"]:
        err.print("error: --write and --diff exclude each other", highlight=False, markup=False)
        return EXIT_ERROR
    if options["output_format"] not in FORMATS:
        err.print(f"error: --format must be one of {', '.join(FORMATS)}", highlight=False, markup=False)
        return EXIT_ERROR
    try:
        stdin = stdin_path(paths, options["stdin_filename"])
        paths = [stdin] if stdin is not None else paths or ["."]
        config = build_config(
            paths, options["select"], options["ignore"], options["config_file"], options["target"],
            tower_input=options["tower_input"],
        )
    except (ConfigError, ValueError) as exc:
        err.print(f"error: {exc}", highlight=False, markup=False)
        return EXIT_ERROR
    options["stdin"] = stdin is not None
    missing: list[str] = []
    skipped: list = []
    if stdin is not None:
        results = _fix_stdin(stdin, config, options["unsafe"], options["force_exclude"])
    else:
        results, missing, skipped = _fix_files(paths, config, options, err)
    _print_results(results, missing, options, err)
    if not options["quiet"]:
        for line in _summary(results, missing, options["write"] or options["stdin"], options["unsafe"], skipped):
            err.print(line, highlight=False, markup=False)
    return _exit_status(results, missing, options)


def register(app: typer.Typer) -> None:
    from tfmigrate.cli.main import (
        ConfigOpt, ExitZeroOpt, ForceExcludeOpt, FormatOpt, IgnoreOpt, JobsOpt, NoCacheOpt, PathsArg,
        SelectOpt, StatisticsOpt, StdinFilenameOpt,
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
        tower_input: Optional[str] = typer.Option(
            None, "--tower-input",
            help="The towers' input, compat target: keep (default: feeds, splits and queues stay) or dataset "
                 "(fed batches become a distributed tf.data pipeline).",
        ),
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
        output_format: str = FormatOpt,
        statistics: bool = StatisticsOpt,
        exit_zero: bool = ExitZeroOpt,
        no_cache: bool = NoCacheOpt,
        stdin_filename: Optional[str] = StdinFilenameOpt,
    ) -> None:
        """Rewrite legacy patterns to tf.distribute / tf.data (a diff unless --write; `-`: standard
        input to standard output). --format and --statistics report the findings that remain."""
        # `fix` reads every file afresh and writes no cache: --no-cache is accepted for
        # symmetry with `check` (scripts pass both the same options).
        del no_cache
        raise typer.Exit(run_fix(paths, {
            "write": write, "diff": diff, "unsafe": unsafe_fixes, "select": select, "ignore": ignore,
            "target": target, "tower_input": tower_input, "exit_non_zero_on_fix": exit_non_zero_on_fix, "quiet": quiet,
            "show_refusals": show_refusals, "config_file": config_file, "force_exclude": force_exclude,
            "jobs": jobs, "output_format": output_format, "statistics": statistics, "exit_zero": exit_zero,
            "stdin_filename": stdin_filename,
        }))
