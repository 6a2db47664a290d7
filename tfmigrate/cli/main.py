"""The `tfmigrate` command line: check, fix, rules, explain, verify."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, List, Optional

from tfmigrate import __version__
from tfmigrate.engine.config import TARGETS, TOWER_INPUTS, Config, ConfigError, load_config
from tfmigrate.engine.discovery import discover
from tfmigrate.findings import FileResult
from tfmigrate.engine.registry import all_rules, catalog, rule_by_code
from tfmigrate.engine.reporters import (
    FORMATS, PlainConsole, no_color, plain_stream, render_text, statistics_table, summary_line,
    write_machine,
)
from tfmigrate.engine.runner import check_file

if TYPE_CHECKING:
    from rich.console import Console

# Start-up matters (a pre-commit hook runs `check` on one file). Nothing imported above loads
# LibCST or a rule: the rules are imported when a file has to be parsed, or when the rule
# catalog is not in the cache yet. rich is loaded when something is printed. Typer (with the
# pydantic it builds its parameter converters with: ~0.3 s) is loaded only for the command
# line that `main()`'s fast path does not read itself (see `_plain_check`): the Typer app,
# `app`, is built on first use (`__getattr__` at the end of this module).

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2

def _stdout() -> Console:
    from rich.console import Console

    # NO_COLOR: rich would still write bold and other styles; no colour system writes none.
    # emoji=False: `path:100:5:` is a location, not the emoji code `:100:`.
    return Console(soft_wrap=True, emoji=False, **({"color_system": None} if no_color() else {}))


def stderr_console() -> Console:
    """A rich console on stderr (messages, progress), shared by every command."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, emoji=False, **({"color_system": None} if no_color() else {}))


def _text_out(stderr: bool = False) -> Console | PlainConsole:
    """Where lines of text go: rich on a terminal, the stream itself when rich would not
    style it anyway (a pipe, a file, CI)."""
    stream = sys.stderr if stderr else sys.stdout
    if plain_stream(stream):
        return PlainConsole(stream)
    return stderr_console() if stderr else _stdout()


def _split_codes(values: Optional[List[str]]) -> list[str]:
    codes: list[str] = []
    for value in values or []:
        codes += [_code_of(c.strip()) for c in value.split(",") if c.strip()]
    return codes


def _code_of(code_or_name: str) -> str:
    """A rule code or prefix as given, or the code of the rule named so (`manual-tower-loop`),
    as `explain` accepts."""
    name = code_or_name.lower()
    return next((info.code for info in catalog() if info.name == name), code_or_name.upper())


def _known_prefix(code: str) -> bool:
    return any(info.code.startswith(code) for info in catalog())


def install_catalog(config: Config) -> None:
    """Use the rule catalog stored in the cache folder; compute (importing the rules) and store
    it when it is not there yet."""
    from tfmigrate.engine import registry
    from tfmigrate.engine.cache import cache_root, load_catalog, save_catalog

    root = cache_root(config.root)
    stored = load_catalog(root)
    if stored is not None:
        registry.use_catalog(stored)
    else:
        save_catalog(root, registry.catalog())


def build_config(
    paths: list[str], select: Optional[List[str]], ignore: Optional[List[str]], config_file: Optional[str],
    target: Optional[str] = None, *, use_cache: bool = False, tower_input: Optional[str] = None,
) -> Config:
    """Config from pyproject.toml, with the command line on top, as in ruff: ``--select``
    replaces the file's ``select`` and ``ignore`` (per-file ignores stay), ``--ignore`` adds.
    Rule names stand for their codes. Raises ConfigError on nonsense. ``use_cache``: take the
    rule catalog from the cache folder (see ``install_catalog``)."""
    config = load_config(paths, config_file)
    if use_cache:
        install_catalog(config)
    selected, ignored = _split_codes(select), _split_codes(ignore)
    config.select, config.ignore = _split_codes(config.select), _split_codes(config.ignore)
    config.per_file_ignores = {pattern: _split_codes(codes) for pattern, codes in config.per_file_ignores.items()}
    for code in selected + ignored + config.select + config.ignore + sum(config.per_file_ignores.values(), []):
        if not _known_prefix(code):
            raise ConfigError(f"unknown rule code or prefix: {code} (see `tfmigrate rules`)")
    if selected:
        config.select, config.ignore = selected, []
    config.ignore = config.ignore + ignored
    if target is not None:
        if target not in TARGETS:
            raise ConfigError(f"--target must be one of {', '.join(TARGETS)}")
        config.target = target
    if tower_input is not None:
        if tower_input not in TOWER_INPUTS:
            raise ConfigError(f"--tower-input must be one of {', '.join(TOWER_INPUTS)}")
        config.tower_input = tower_input
    return config


def _progress_bar(label: str, total: int, quiet: bool):
    """A rich progress bar on a terminal, when colour is allowed (it moves the cursor with
    escape codes); None elsewhere."""
    if quiet or total <= 1 or no_color() or not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr_console(), transient=True,
    )


def run_files(
    files: list[str], config: Config, work, *, quiet: bool, label: str = "Checking", jobs: int | None = None,
    on_crash=None,
) -> list:
    """Run ``work(path, config)`` over the files, in worker processes when there are enough of
    them (see :mod:`tfmigrate.engine.workers`: a crashed worker costs only its own file, Ctrl-C raises
    ``Interrupted`` with what was finished), with a progress bar on a terminal only. Results
    come back in the order of ``files``.

    ``work`` must be picklable (a module-level function or a ``functools.partial`` of one) and
    return plain data: workers send back results, never syntax trees. ``on_crash(path, why)``:
    the result for a file whose worker process died (default: a ``FileResult`` error).
    """
    from tfmigrate.engine import workers

    jobs = max(1, jobs or workers.default_jobs())
    progress = _progress_bar(label, len(files), quiet)
    task = progress.add_task(label, total=len(files)) if progress is not None else None

    def advance(count: int) -> None:
        if task is not None:
            progress.advance(task, count)

    @contextlib.contextmanager
    def pause():  # no progress thread while forking (a lock held by it would stay held in the child)
        if progress is not None:
            progress.stop()
        try:
            yield
        finally:
            if progress is not None:
                progress.start()

    crashed = on_crash or (lambda path, why: FileResult(path=path, error=f"the process checking it died ({why}); not checked"))
    with progress if progress is not None else contextlib.nullcontext():
        if jobs > 1 and len(files) > workers.PARALLEL_MIN_FILES:
            from tfmigrate.engine import runner

            runner.enabled_rules(config)  # import the rules here, once, before the workers fork
            return workers.run_pool(files, config, work, jobs, advance, crashed, pause)
        results: list = [None] * len(files)
        try:
            for index, path in enumerate(files):
                results[index] = work(path, config)
                advance(1)
        except KeyboardInterrupt as stop:
            if getattr(stop, "result", None) is not None:  # a file written as Ctrl-C came
                results[index] = stop.result
            raise workers.Interrupted(results, sum(1 for r in results if getattr(r, "written", False))) from None
        return results


def check_files(
    files: list[str], config: Config, *, quiet: bool, jobs: int | None = None, use_cache: bool = True,
) -> list[FileResult]:
    """`check` over the files: cached results where the cache has them, the rest computed."""
    cache = None
    if use_cache:
        from tfmigrate.engine.cache import Cache

        cache = Cache.for_config(config)
    results: list[FileResult | None] = [None] * len(files)
    todo: list[int] = []
    for index, path in enumerate(files):
        hit = cache.get(path, config) if cache is not None else None
        if hit is None:
            todo.append(index)
        else:
            results[index] = hit
    fresh = run_files([files[i] for i in todo], config, check_file, quiet=quiet, jobs=jobs)
    for index, result in zip(todo, fresh):
        results[index] = result
        if cache is not None:
            cache.put(result, config)
    if cache is not None:
        cache.flush()
    return results  # type: ignore[return-value]


def print_notes(results, err: Console) -> None:
    for result in results:
        for note in result.notes:
            err.print(f"{result.path}: note: {note}", highlight=False, markup=False)


def print_skipped(skipped: list[tuple[str, str]], err) -> None:
    """What the walk of a folder left alone (a symlink loop...): one line each."""
    for path, why in skipped:
        err.print(f"{path}: warning: {why}", highlight=False, markup=False)


def print_errors(errors: list[tuple[str, str]], err) -> None:
    for path, message in errors:
        err.print(f"{path}: error: {message}", highlight=False, markup=False)


def report(
    findings: list, errors: list[tuple[str, str]], *, output_format: str, statistics: bool, quiet: bool,
    show_source: bool = True, summary: str | None = None, lines_of: dict | None = None, to_stderr: bool = False,
) -> None:
    """Findings and per-file errors in the chosen format on stdout (``to_stderr``: on stderr,
    when stdout carries `fix -`'s code), errors one line each on stderr as well (CI logs show
    them); the summary line under the text report."""
    err = _text_out(stderr=True)
    if output_format != "text":
        write_machine(output_format, findings, errors, sys.stderr if to_stderr else sys.stdout)
    elif statistics:
        if findings:
            (stderr_console() if to_stderr else _stdout()).print(statistics_table(findings))
    else:
        out = _text_out(stderr=to_stderr)
        render_text(findings, [], out, show_source=show_source and not quiet, lines_of=lines_of)
        print_errors(errors, err)
        if summary is not None and not quiet:
            out.print(summary, highlight=False, markup=False)
        return
    print_errors(errors, err)


def stdin_path(paths: Optional[List[str]], stdin_filename: Optional[str]) -> str | None:
    """The name stdin's content is reported under (``-`` as a path, or ``--stdin-filename``
    alone, as in ruff), or None when the paths name files. ValueError: ``-`` among others."""
    if paths and "-" in paths and len(paths) > 1:
        raise ValueError("`-` (standard input) cannot be mixed with other paths")
    if paths == ["-"] or (not paths and stdin_filename):
        return stdin_filename or "-"
    return None


def read_stdin(name: str, config: Config, force_exclude: bool) -> tuple[bytes, bool]:
    """Standard input's bytes, and whether ``--force-exclude`` excludes the name they stand for."""
    raw = sys.stdin.buffer.read()
    return raw, force_exclude and not discover([name], config, force_exclude=True, virtual=True).files


def _check_stdin(name: str, config: Config, force_exclude: bool) -> tuple[list[FileResult], dict]:
    from tfmigrate.engine.runner import check_bytes
    from tfmigrate.engine.source import split_lines

    raw, excluded = read_stdin(name, config, force_exclude)
    if excluded:
        return [], {}
    lines = {name: split_lines(raw.decode("utf-8", errors="replace"))}
    return [check_bytes(name, raw, config)], ({} if name.endswith(".ipynb") else lines)


def run_check(
    paths: Optional[List[str]] = None, output_format: str = "text", select: Optional[List[str]] = None,
    ignore: Optional[List[str]] = None, statistics: bool = False, quiet: bool = False, show_source: bool = True,
    exit_zero: bool = False, target: Optional[str] = None, config_file: Optional[str] = None,
    force_exclude: bool = False, jobs: Optional[int] = None, no_cache: bool = False,
    stdin_filename: Optional[str] = None,
) -> int:
    """`tfmigrate check`; returns the exit status (the Typer command and the fast path in
    `main()` both call this). ``exit_zero``: 0 even with findings or files that could not be
    checked (usage errors stay 2)."""
    err = _text_out(stderr=True)
    if output_format not in FORMATS:
        err.print(f"error: --format must be one of {', '.join(FORMATS)}")
        return EXIT_ERROR
    try:
        stdin = stdin_path(paths, stdin_filename)
        paths = [stdin] if stdin is not None else paths or ["."]
        config = build_config(paths, select, ignore, config_file, target, use_cache=not no_cache and stdin is None)
    except (ConfigError, ValueError) as exc:
        err.print(f"error: {exc}", highlight=False, markup=False)
        return EXIT_ERROR
    missing: list[str] = []
    lines_of: dict = {}
    if stdin is not None:
        results, lines_of = _check_stdin(stdin, config, force_exclude)
    else:
        found = discover(paths, config, force_exclude=force_exclude)
        missing = found.missing
        print_skipped(found.skipped, err)
        results = check_files(
            found.files, config, quiet=quiet or output_format != "text", jobs=jobs, use_cache=not no_cache
        )
    if not quiet:
        print_notes(results, err)
    findings = sorted((f for r in results for f in r.findings), key=lambda f: f.sort_key())
    errors = [(path, "no such file or directory") for path in missing]
    errors += [(r.path, r.error) for r in results if r.error]
    report(
        findings, errors, output_format=output_format, statistics=statistics, quiet=quiet,
        show_source=show_source, summary=summary_line(findings, errors, len(results)), lines_of=lines_of,
    )
    if exit_zero:
        return EXIT_CLEAN
    if errors:
        return EXIT_ERROR
    return EXIT_FINDINGS if any(not f.informational for f in findings) else EXIT_CLEAN


# --- main() and its fast path ---------------------------------------------------------------
# `check`'s options, as (keyword of run_check, takes a value). Any other argument, a repeated
# single-valued option, or a value the fast path would have to judge (a number for --jobs that
# is not a positive integer, a value that looks like an option) sends the whole command line
# to Typer, which then answers exactly as it always has (usage errors, --help...).
_CHECK_VALUES = {
    "--format": "output_format", "--target": "target", "--config": "config_file", "--jobs": "jobs", "-j": "jobs",
    "--stdin-filename": "stdin_filename",
}
_CHECK_LISTS = {"--select": "select", "--ignore": "ignore"}
_CHECK_FLAGS = {
    "--statistics": ("statistics", True), "--quiet": ("quiet", True), "-q": ("quiet", True),
    "--show-source": ("show_source", True), "--no-show-source": ("show_source", False),
    "--exit-zero": ("exit_zero", True), "--force-exclude": ("force_exclude", True), "--no-cache": ("no_cache", True),
}


def _plain_check(argv: list[str]) -> dict | None:
    """run_check's arguments for a plain ``check ...`` command line; None for anything else."""
    if not argv or argv[0] != "check":
        return None
    options: dict = {}
    paths: list[str] = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--":
            paths += rest
            break
        if not arg.startswith("-") or arg == "-":
            paths.append(arg)
            continue
        name, equals, value = arg.partition("=")
        if name in _CHECK_FLAGS and not equals:
            key, flag = _CHECK_FLAGS[name]
            options[key] = flag
            continue
        if name not in _CHECK_VALUES and name not in _CHECK_LISTS:
            return None
        if not equals:
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
        if name in _CHECK_LISTS:
            options.setdefault(_CHECK_LISTS[name], []).append(value)
            continue
        key = _CHECK_VALUES[name]
        if key in options:
            return None
        if key == "jobs":
            if not value.isdigit() or int(value) < 1:
                return None
            options[key] = int(value)
        else:
            options[key] = value
    return {"paths": paths or None, **options}


def main() -> None:
    try:
        _main()
    except BrokenPipeError:
        # The reader went away (`tfmigrate check src | head`): stop quietly, as ruff does, with
        # nothing more written to the closed pipe (Python would report it again at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _main() -> None:
    arguments = _plain_check(sys.argv[1:])
    if arguments is None:
        __getattr__("app")()
        return
    try:
        status = run_check(**arguments)
    except KeyboardInterrupt:  # what Typer (click) does
        print("\nAborted!", file=sys.stderr)
        status = 1
    sys.exit(status)


# --- the Typer app (built on first use) -----------------------------------------------------
_TYPER_NAMES = (
    "app", "PathsArg", "SelectOpt", "IgnoreOpt", "ConfigOpt", "ForceExcludeOpt", "JobsOpt", "FormatOpt",
    "StatisticsOpt", "ExitZeroOpt", "NoCacheOpt", "StdinFilenameOpt",
)


def _define_options(typer) -> None:
    """The Typer parameters `check` and `fix` share."""
    global PathsArg, SelectOpt, IgnoreOpt, ConfigOpt, ForceExcludeOpt, JobsOpt
    global FormatOpt, StatisticsOpt, ExitZeroOpt, NoCacheOpt, StdinFilenameOpt

    PathsArg = typer.Argument(None, help="Files or folders to check (default: the current folder).")
    SelectOpt = typer.Option(
        None, "--select", help="Only these codes, prefixes or rule names (e.g. TFM1,multi-gpu-model)."
    )
    IgnoreOpt = typer.Option(None, "--ignore", help="Skip these codes or prefixes.")
    ConfigOpt = typer.Option(None, "--config", help="Read this pyproject.toml instead of the nearest one.")
    ForceExcludeOpt = typer.Option(
        False, "--force-exclude", help="Apply `exclude` to files named on the command line too (pre-commit)."
    )
    JobsOpt = typer.Option(None, "--jobs", "-j", min=1, help="Worker processes (default: one per core).")
    FormatOpt = typer.Option("text", "--format", help=f"One of: {', '.join(FORMATS)}.")
    StatisticsOpt = typer.Option(False, "--statistics", help="Count findings per code instead of listing them.")
    ExitZeroOpt = typer.Option(
        False, "--exit-zero", help="Exit 0 even with findings or files that could not be checked."
    )
    NoCacheOpt = typer.Option(False, "--no-cache", help="Neither read nor write the cache (.tfmigrate_cache/).")
    StdinFilenameOpt = typer.Option(
        None, "--stdin-filename", help="The file name standard input (`-`) stands for: reported, configured as."
    )


def _build_app() -> None:
    import typer

    global app

    _define_options(typer)
    app = typer.Typer(
        name="tfmigrate",
        help="Find hand-rolled TensorFlow multi-GPU code and migrate it to tf.distribute and tf.data.",
        add_completion=False,
        no_args_is_help=True,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
    )

    @app.command()
    def check(
        paths: Optional[List[str]] = PathsArg,
        output_format: str = FormatOpt,
        select: Optional[List[str]] = SelectOpt,
        ignore: Optional[List[str]] = IgnoreOpt,
        statistics: bool = StatisticsOpt,
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print findings only, no source lines or summary."),
        show_source: bool = typer.Option(True, "--show-source/--no-show-source", help="Show the offending line."),
        exit_zero: bool = ExitZeroOpt,
        target: Optional[str] = typer.Option(None, "--target", help="Migration target: compat or tf2."),
        config_file: Optional[str] = ConfigOpt,
        force_exclude: bool = ForceExcludeOpt,
        jobs: Optional[int] = JobsOpt,
        no_cache: bool = NoCacheOpt,
        stdin_filename: Optional[str] = StdinFilenameOpt,
    ) -> None:
        """Report legacy multi-GPU and queue-input patterns (`-` reads standard input)."""
        raise typer.Exit(run_check(
            paths, output_format, select, ignore, statistics, quiet, show_source, exit_zero, target, config_file,
            force_exclude, jobs, no_cache, stdin_filename,
        ))

    def _version_callback(value: bool) -> None:
        if value:
            print(f"tfmigrate {__version__}")
            raise typer.Exit()

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ) -> None:
        pass

    _register_rule_commands(app)
    _register_optional_commands(app)


def _register_rule_commands(app) -> None:
    """`rules` and `explain`."""
    import typer

    @app.command("rules")
    def list_rules(
        output_format: str = typer.Option("text", "--format", help="text or json."),
    ) -> None:
        """List every rule: code, name, fix safety, summary."""
        from rich.table import Table

        if output_format == "json":
            import json

            json.dump([
                {"code": r.code, "name": r.name, "summary": r.summary, "fix": r.fix_safety.value,
                 "informational": r.informational}
                for r in all_rules()
            ], sys.stdout, indent=2)
            sys.stdout.write("\n")
            return
        table = Table(box=None, header_style="bold")
        table.add_column("code")
        table.add_column("name")
        table.add_column("fix")
        table.add_column("summary")
        for rule in all_rules():
            table.add_row(rule.code, rule.name, rule.fix_safety.value, rule.summary)
        _stdout().print(table)

    @app.command()
    def explain(code: str = typer.Argument(..., help="A rule code (TFM101) or name (manual-tower-loop).")) -> None:
        """Show a rule's documentation, with its before/after example."""
        rule = rule_by_code(code)
        if rule is None:
            stderr_console().print(f"error: unknown rule: {code} (see `tfmigrate rules`)", highlight=False, markup=False)
            raise typer.Exit(EXIT_ERROR)
        out = _stdout()
        if out.is_terminal:
            from rich.markdown import Markdown

            out.print(Markdown(rule.documentation()))
        else:
            sys.stdout.write(rule.documentation())


def _register_optional_commands(app) -> None:
    """Commands that live in their own modules (none of them imports TensorFlow at load)."""
    import importlib

    for module_name in ("tfmigrate.cli.fix", "tfmigrate.verify.cli"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        module.register(app)


def __getattr__(name: str):
    """``app`` and the shared Typer parameters, built on first use."""
    if name in _TYPER_NAMES:
        if "app" not in globals():
            _build_app()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
