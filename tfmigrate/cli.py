"""The `tfmigrate` command line: check, fix, rules, explain, verify."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, List, Optional

from tfmigrate import __version__
from tfmigrate.config import TARGETS, Config, ConfigError, load_config
from tfmigrate.discovery import discover
from tfmigrate.findings import FileResult
from tfmigrate.registry import all_rules, catalog, rule_by_code
from tfmigrate.reporters import (
    FORMATS, PlainConsole, plain_stream, render_text, statistics_table, summary_line, write_machine,
)
from tfmigrate.runner import check_file

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

    return Console(soft_wrap=True)


def stderr_console() -> Console:
    """A rich console on stderr (messages, progress), shared by every command."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


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
        codes += [c.strip().upper() for c in value.split(",") if c.strip()]
    return codes


def _known_prefix(code: str) -> bool:
    return any(info.code.startswith(code) for info in catalog())


def install_catalog(config: Config) -> None:
    """Use the rule catalog stored in the cache folder; compute (importing the rules) and store
    it when it is not there yet."""
    from tfmigrate import registry
    from tfmigrate.cache import cache_root, load_catalog, save_catalog

    root = cache_root(config.root)
    stored = load_catalog(root)
    if stored is not None:
        registry.use_catalog(stored)
    else:
        save_catalog(root, registry.catalog())


def build_config(
    paths: list[str], select: Optional[List[str]], ignore: Optional[List[str]], config_file: Optional[str],
    target: Optional[str] = None, *, use_cache: bool = False,
) -> Config:
    """Config from pyproject.toml, with the command line on top (``--select`` replaces,
    ``--ignore`` adds, as in ruff). Raises ConfigError on nonsense. ``use_cache``: take the
    rule catalog from the cache folder (see ``install_catalog``)."""
    config = load_config(paths, config_file)
    if use_cache:
        install_catalog(config)
    selected, ignored = _split_codes(select), _split_codes(ignore)
    for code in selected + ignored + config.select + config.ignore:
        if not _known_prefix(code):
            raise ConfigError(f"unknown rule code or prefix: {code} (see `tfmigrate rules`)")
    if selected:
        config.select = selected
    config.ignore = config.ignore + ignored
    if target is not None:
        if target not in TARGETS:
            raise ConfigError(f"--target must be one of {', '.join(TARGETS)}")
        config.target = target
    return config


# Below this many files a worker pool costs more to start than it saves.
PARALLEL_MIN_FILES = 40


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def _run_chunk(work, paths: list[str], config: Config) -> list:
    return [work(path, config) for path in paths]


def _fork_context():
    """Workers forked from this process start at once, with the rules already imported;
    spawned ones would import everything again (about a second each). macOS and Windows get
    their platform default."""
    import multiprocessing

    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


def run_files(
    files: list[str], config: Config, work, *, quiet: bool, label: str = "Checking", jobs: int | None = None,
) -> list:
    """Run ``work(path, config)`` over the files, in worker processes when there are enough of
    them, with a progress bar on a terminal only. Results come back in the order of ``files``.

    ``work`` must be picklable (a module-level function or a ``functools.partial`` of one) and
    return plain data: workers send back results, never syntax trees.
    """
    jobs = max(1, jobs or default_jobs())
    show_progress = not quiet and sys.stderr.isatty() and len(files) > 1
    pool = None
    futures: dict = {}
    if jobs > 1 and len(files) > PARALLEL_MIN_FILES:
        from concurrent.futures import ProcessPoolExecutor

        from tfmigrate import runner

        runner.enabled_rules(config)  # import the rules here, once, before the workers fork
        # Small chunks balance the load; not too small, each is a round trip to a worker.
        size = max(1, min(50, len(files) // (jobs * 8)))
        chunks = [files[i:i + size] for i in range(0, len(files), size)]
        pool = ProcessPoolExecutor(max_workers=min(jobs, len(chunks)), mp_context=_fork_context())
        # Submitting starts the workers, before the progress bar starts its thread: forking a
        # process that runs threads can deadlock the child.
        futures = {pool.submit(_run_chunk, work, chunk, config): index for index, chunk in enumerate(chunks)}

    progress = contextlib.nullcontext()
    if show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=stderr_console(), transient=True,
        )
    with progress:
        task = progress.add_task(label, total=len(files)) if show_progress else None

        def advance(count: int) -> None:
            if task is not None:
                progress.advance(task, count)

        if pool is None:
            results = []
            for path in files:
                results.append(work(path, config))
                advance(1)
            return results
        from concurrent.futures import as_completed

        with pool:
            done: dict[int, list] = {}
            for future in as_completed(futures):
                chunk_results = future.result()
                done[futures[future]] = chunk_results
                advance(len(chunk_results))
        return [result for index in range(len(done)) for result in done[index]]


def check_files(
    files: list[str], config: Config, *, quiet: bool, jobs: int | None = None, use_cache: bool = True,
) -> list[FileResult]:
    """`check` over the files: cached results where the cache has them, the rest computed."""
    cache = None
    if use_cache:
        from tfmigrate.cache import Cache

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


def run_check(
    paths: Optional[List[str]] = None, output_format: str = "text", select: Optional[List[str]] = None,
    ignore: Optional[List[str]] = None, statistics: bool = False, quiet: bool = False, show_source: bool = True,
    exit_zero: bool = False, target: Optional[str] = None, config_file: Optional[str] = None,
    force_exclude: bool = False, jobs: Optional[int] = None, no_cache: bool = False,
) -> int:
    """`tfmigrate check`; returns the exit status (the Typer command and the fast path in
    `main()` both call this)."""
    paths = paths or ["."]
    err = _text_out(stderr=True)
    if output_format not in FORMATS:
        err.print(f"error: --format must be one of {', '.join(FORMATS)}")
        return EXIT_ERROR
    try:
        config = build_config(paths, select, ignore, config_file, target, use_cache=not no_cache)
    except ConfigError as exc:
        err.print(f"error: {exc}", highlight=False, markup=False)
        return EXIT_ERROR
    found = discover(paths, config, force_exclude=force_exclude)
    results = check_files(
        found.files, config, quiet=quiet or output_format != "text", jobs=jobs, use_cache=not no_cache
    )
    if not quiet:
        print_notes(results, err)
    findings = sorted((f for r in results for f in r.findings), key=lambda f: f.sort_key())
    errors = [(path, "no such file or directory") for path in found.missing]
    errors += [(r.path, r.error) for r in results if r.error]

    if output_format != "text":
        write_machine(output_format, findings, errors, sys.stdout)
        for path, message in errors:  # one line each on stderr as well: CI logs show them
            err.print(f"{path}: error: {message}", highlight=False, markup=False)
    elif statistics:
        out = _stdout()
        if findings:
            out.print(statistics_table(findings))
        for path, message in errors:
            err.print(f"{path}: error: {message}", highlight=False, markup=False)
    else:
        out = _text_out()
        render_text(findings, [], out, show_source=show_source and not quiet)
        for path, message in errors:
            err.print(f"{path}: error: {message}", highlight=False, markup=False)
        if not quiet:
            out.print(summary_line(findings, errors, len(found.files)), highlight=False, markup=False)

    if errors:
        return EXIT_ERROR
    if any(not f.informational for f in findings) and not exit_zero:
        return EXIT_FINDINGS
    return EXIT_CLEAN


# --- main() and its fast path ---------------------------------------------------------------
# `check`'s options, as (keyword of run_check, takes a value). Any other argument, a repeated
# single-valued option, or a value the fast path would have to judge (a number for --jobs that
# is not a positive integer, a value that looks like an option) sends the whole command line
# to Typer, which then answers exactly as it always has (usage errors, --help...).
_CHECK_VALUES = {
    "--format": "output_format", "--target": "target", "--config": "config_file", "--jobs": "jobs", "-j": "jobs",
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
_TYPER_NAMES = ("app", "PathsArg", "SelectOpt", "IgnoreOpt", "ConfigOpt", "ForceExcludeOpt", "JobsOpt")


def _build_app() -> None:
    import typer

    global app, PathsArg, SelectOpt, IgnoreOpt, ConfigOpt, ForceExcludeOpt, JobsOpt

    app = typer.Typer(
        name="tfmigrate",
        help="Find hand-rolled TensorFlow multi-GPU code and migrate it to tf.distribute and tf.data.",
        add_completion=False,
        no_args_is_help=True,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
    )
    PathsArg = typer.Argument(None, help="Files or folders to check (default: the current folder).")
    SelectOpt = typer.Option(None, "--select", help="Only these codes or prefixes (e.g. TFM1,TFM201).")
    IgnoreOpt = typer.Option(None, "--ignore", help="Skip these codes or prefixes.")
    ConfigOpt = typer.Option(None, "--config", help="Read this pyproject.toml instead of the nearest one.")
    ForceExcludeOpt = typer.Option(
        False, "--force-exclude", help="Apply `exclude` to files named on the command line too (pre-commit)."
    )
    JobsOpt = typer.Option(None, "--jobs", "-j", min=1, help="Worker processes (default: one per core).")

    @app.command()
    def check(
        paths: Optional[List[str]] = PathsArg,
        output_format: str = typer.Option("text", "--format", help=f"One of: {', '.join(FORMATS)}."),
        select: Optional[List[str]] = SelectOpt,
        ignore: Optional[List[str]] = IgnoreOpt,
        statistics: bool = typer.Option(False, "--statistics", help="Count findings per code instead of listing them."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Print findings only, no source lines or summary."),
        show_source: bool = typer.Option(True, "--show-source/--no-show-source", help="Show the offending line."),
        exit_zero: bool = typer.Option(False, "--exit-zero", help="Exit 0 even when there are findings."),
        target: Optional[str] = typer.Option(None, "--target", help="Migration target: compat or tf2."),
        config_file: Optional[str] = ConfigOpt,
        force_exclude: bool = ForceExcludeOpt,
        jobs: Optional[int] = JobsOpt,
        no_cache: bool = typer.Option(False, "--no-cache", help="Neither read nor write the cache (.tfmigrate_cache/)."),
    ) -> None:
        """Report legacy multi-GPU and queue-input patterns."""
        raise typer.Exit(run_check(
            paths, output_format, select, ignore, statistics, quiet, show_source, exit_zero, target, config_file,
            force_exclude, jobs, no_cache,
        ))

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

    _register_optional_commands(app)


def _register_optional_commands(app) -> None:
    """Commands that live in their own modules (none of them imports TensorFlow at load)."""
    import importlib

    for module_name in ("tfmigrate.fixer_cli", "tfmigrate.verify.cli"):
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
