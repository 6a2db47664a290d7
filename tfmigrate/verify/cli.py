"""``tfmigrate verify OLD NEW``: train both programs side by side and compare loss and speed.

Importing this module must stay cheap: no TensorFlow, NumPy or matplotlib here (they are
imported by the harness subprocesses and, for ``--plot``, inside :func:`verify`).
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from tfmigrate.verify.compare import DEFAULT_ATOL, DEFAULT_RTOL, compare
from tfmigrate.verify.detect import detect
from tfmigrate.verify.runner import RunOutcome, RunSpec, run_program

EXIT_MATCH, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
LEGACY_CHOICES = ("auto", "old", "new", "both", "none")


def _err() -> Console:
    return Console(stderr=True, soft_wrap=True, highlight=False, emoji=False)


def _fail(message: str, outcome: Optional[RunOutcome] = None, json_path: Optional[str] = None,
          partial: Optional[dict] = None) -> None:
    err = _err()
    err.print(f"error: {message}", markup=False)
    tail = ""
    if outcome is not None:
        tail = outcome.tail()
        if tail:
            err.print(f"--- last lines of {outcome.spec.label} {outcome.spec.program.name} ---", markup=False)
            err.print(tail, markup=False)
            err.print("---", markup=False)
    if json_path:
        from tfmigrate.verify.report import write_json

        report = dict(partial or {})
        report.update({"verdict": "error", "exit_code": EXIT_ERROR, "error": message, "output_tail": tail})
        write_json(Path(json_path), report)
    raise typer.Exit(EXIT_ERROR)


def _weights_summary(old: dict, new: dict) -> dict:
    loaded = (new.get("weights") or {})
    dumped = (old.get("weights") or {})
    count, total = loaded.get("loaded", 0), loaded.get("variables", 0)
    info = {"matched": bool(count), "variables_matched": count, "new_trainable_variables": total,
            "old_trainable_variables": dumped.get("dumped", 0), "matched_by": loaded.get("matched_by"),
            "unmatched": loaded.get("unmatched", [])}
    if count:
        info["summary"] = (f"{count} of {total} NEW trainable variables start from OLD's initial values "
                           f"(matched by {loaded.get('matched_by')})")
    elif dumped.get("dumped") is None:
        info["summary"] = "not matched (OLD's initial values were not captured)"
    else:
        info["summary"] = "not matched (no variable with the same name and shape): runs start from their own seeded init"
    return info


def _side(outcome: RunOutcome, detection) -> dict:
    result = outcome.result or {}
    steps = [{"step": s["step"], "loss": s.get("loss"), "examples": s.get("examples"),
              "seconds": (s["t_end"] - s["t_start"]) if s.get("t_start") is not None else None,
              "t_start": s.get("t_start"), "t_end": s.get("t_end")} for s in result.get("steps", [])]
    mode = "legacy TF1 (compat.v1, v2 off)" if outcome.spec.legacy else "as written (TF2)"
    if outcome.spec.keras and outcome.spec.legacy:
        mode += ", Keras 2"
    elif outcome.spec.multi_gpu_tf2:
        mode += ", Keras 2 with multi_gpu_model restored"
    elif outcome.spec.keras2 and not outcome.spec.legacy:
        mode += ", Keras 2 for its tf.compat.v1 layers"
    return {
        "program": str(outcome.spec.program), "legacy": outcome.spec.legacy, "mode": mode,
        "legacy_reasons": detection.reasons[:8], "loss_source": result.get("loss_source"),
        "finished": result.get("finished"), "steps": steps, "notes": result.get("notes", []),
        "weights": result.get("weights"), "setup_s": result.get("setup_s"), "wall_s": outcome.seconds,
    }


@dataclass
class _Job:
    """What travels between verify's steps: the programs, how each runs, the options and the console."""

    paths: List[Path]
    detections: list
    flags: List[bool]
    settings: dict          # the options, as the report lists them
    progress: bool
    quiet: bool
    json_path: Optional[str]
    plot_path: Optional[str]
    out: Console


def verify(
    old: str = typer.Argument(..., help="The legacy program (reference)."),
    new: str = typer.Argument(..., help="The migrated program."),
    program_args: Optional[List[str]] = typer.Argument(None, help="After `--`: arguments passed to both programs."),
    steps: int = typer.Option(20, "--steps", min=1, help="Training steps to capture from each program."),
    devices: int = typer.Option(2, "--devices", min=1, help="Replicas: K GPUs if visible, else K logical CPU devices."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Steps left out of the throughput measurement."),
    seed: int = typer.Option(0, "--seed", help="Seed for Python, NumPy and TensorFlow in both runs."),
    rtol: float = typer.Option(DEFAULT_RTOL, "--rtol", help="Relative tolerance on each step's loss."),
    atol: float = typer.Option(DEFAULT_ATOL, "--atol", help="Absolute tolerance on each step's loss."),
    loss_regex: Optional[str] = typer.Option(
        None, "--loss-regex", help="Read the loss from printed lines instead (group `loss` or the first group)."),
    legacy: str = typer.Option("auto", "--legacy", help="Which programs run in TF1 mode: old, new, both, none, auto."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of both loss curves and throughput."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds each program may run."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print the verdict only."),
    keep_shuffles: bool = typer.Option(
        False, "--keep-shuffles", help="Shuffle input as the programs do (by default both read it in order: a queue's "
                                       "shuffle and tf.data's draw from different random streams)."),
    keep_dropout: bool = typer.Option(
        False, "--keep-dropout", help="Keep Keras's dropout layers on (by default both runs turn them off: a parallel "
                                      "model's slices and the replicas draw their masks from different random streams)."),
) -> None:
    """Train OLD and NEW side by side; compare loss per step and throughput (exit 0 match, 1 mismatch, 2 error)."""
    _check_options(legacy, loss_regex)
    paths = _program_paths(old, new)
    sources = [p.read_text(errors="replace") for p in paths]
    detections = [detect(s) for s in sources]
    flags = {
        "auto": [d.legacy for d in detections], "old": [True, False], "new": [False, True],
        "both": [True, True], "none": [False, False],
    }[legacy]
    settings = {"steps": steps, "devices": devices, "warmup": warmup, "seed": seed, "rtol": rtol, "atol": atol,
                "legacy": legacy, "loss_regex": loss_regex, "timeout": timeout, "program_args": program_args or [],
                "in_order": not keep_shuffles, "no_dropout": not keep_dropout}
    progress = not quiet and sys.stderr.isatty()
    out = Console(soft_wrap=True, emoji=False)
    job = _Job(paths=paths, detections=detections, flags=flags, settings=settings, progress=progress,
               quiet=quiet, json_path=json_path, plot_path=plot_path, out=out)
    outcomes = _run_both(job)
    report, comparison = _build_report(job, outcomes)
    _write_outputs(job, report, comparison)
    raise typer.Exit(report["exit_code"])


def _check_options(legacy: str, loss_regex: Optional[str]) -> None:
    """Fail on a --legacy choice or a --loss-regex that cannot be used."""
    if legacy not in LEGACY_CHOICES:
        _fail(f"--legacy must be one of {', '.join(LEGACY_CHOICES)}")
    if loss_regex:
        import re

        try:
            re.compile(loss_regex)
        except re.error as exc:
            _fail(f"--loss-regex is not a valid regular expression: {exc}")


def _program_paths(old: str, new: str) -> List[Path]:
    """The resolved paths of OLD and NEW; fail when one is not a file."""
    paths = []
    for label, name in (("OLD", old), ("NEW", new)):
        path = Path(name)
        if not path.is_file():
            _fail(f"{label} program {name}: no such file")
        paths.append(path.resolve())
    return paths


def _run_both(job: _Job) -> List[RunOutcome]:
    """Run OLD then NEW in a scratch folder (NEW starts from OLD's initial weights); fail on a bad run."""
    settings = job.settings
    with tempfile.TemporaryDirectory(prefix="tfmigrate-verify-") as tmp:
        workdir = Path(tmp)
        weights = workdir / "old_initial_weights.npz"
        outcomes: list[RunOutcome] = []
        for index, label in enumerate(("OLD", "NEW")):
            spec = RunSpec(
                label=label, program=job.paths[index], legacy=job.flags[index], keras=job.detections[index].keras,
                steps=settings["steps"], devices=settings["devices"], seed=settings["seed"],
                timeout=settings["timeout"], workdir=workdir,
                dump_weights=weights if label == "OLD" else None,
                load_weights=weights if label == "NEW" else None,
                loss_regex=settings["loss_regex"], program_args=list(settings["program_args"]),
                keras2=job.detections[index].keras2, in_order=settings["in_order"], no_dropout=settings["no_dropout"],
                multi_gpu_tf2=job.detections[index].multi_gpu_tf2 and not job.flags[index],
            )
            outcome = _run_one(job, spec)
            outcomes.append(outcome)
            _check_outcome(job, outcome)
    return outcomes


def _run_one(job: _Job, spec: RunSpec) -> RunOutcome:
    """Run one program, with a live status line on a terminal, and say how long it took."""
    label = spec.label
    mode = "legacy TF1" if spec.legacy else "TF2"
    description = f"{label} {spec.program.name} ({mode}, {spec.devices} devices, {spec.steps} steps)"
    if job.progress:
        with _err().status(description) as status:
            outcome = run_program(spec, lambda s: status.update(f"{description}: {s:.0f}s"))
    else:
        outcome = run_program(spec)
    if not job.quiet:
        _err().print(f"{label}: {spec.program.name} ran in {outcome.seconds:.1f}s", markup=False)
    return outcome


def _check_outcome(job: _Job, outcome: RunOutcome) -> None:
    """Fail when the run did not finish or captured no training step or no loss."""
    spec = outcome.spec
    label, loss_regex = spec.label, spec.loss_regex
    json_path = job.json_path
    partial = {"settings": job.settings, "old": str(job.paths[0]), "new": str(job.paths[1])}
    if not outcome.ok:
        _fail(outcome.failure(), outcome, json_path, partial)
    captured = outcome.result.get("steps") or []
    if not captured:
        _fail(f"{label} {spec.program.name}: no training step was captured (no Session.run of a train op, "
              f"no Keras fit batch{', no --loss-regex match' if loss_regex else ''}); "
              f"try --loss-regex", outcome, json_path, partial)
    if all(s.get("loss") is None for s in captured):
        _fail(f"{label} {spec.program.name}: training steps were captured but no loss; "
              f"pass --loss-regex to read it from the program's output", outcome, json_path, partial)


def _build_report(job: _Job, outcomes: List[RunOutcome]):
    """Compare the two runs' steps; the report (verdict, sides, comparison, notes) and the comparison."""
    settings = job.settings
    old_out, new_out = outcomes
    comparison = compare(old_out.result["steps"], new_out.result["steps"], rtol=settings["rtol"],
                         atol=settings["atol"], warmup=settings["warmup"])
    notes = []
    for outcome in outcomes:
        for note in outcome.result.get("notes", []):
            notes.append(f"{outcome.spec.label}: {note}")
    shuffles_off = [outcome.result.get("shuffles_off") or [] for outcome in outcomes]
    if any(shuffles_off):
        notes.append(_in_order_note(shuffles_off))
    if bool(shuffles_off[0]) != bool(shuffles_off[1]):  # a rewrite that dropped (or added) a shuffle
        shuffled, plain = ("OLD", "NEW") if shuffles_off[0] else ("NEW", "OLD")
        comparison.verdict = "mismatch"
        comparison.reasons.append(f"{shuffled} shuffles its input and {plain} does not")
    dropout_off = [outcome.result.get("dropout_off") or [] for outcome in outcomes]
    if any(dropout_off):
        notes.append(_turned_off_note(
            "Keras dropout off in both runs (--keep-dropout keeps it: a parallel model's slices and the replicas "
            "draw their masks from different random streams); turned off", dropout_off))
    if len(dropout_off[0]) != len(dropout_off[1]):  # a rewrite that dropped (or added) a dropout layer
        comparison.verdict = "mismatch"
        comparison.reasons.append(f"OLD has {len(dropout_off[0])} dropout layers and NEW {len(dropout_off[1])}")
    exit_code = EXIT_MATCH if comparison.verdict == "match" else EXIT_MISMATCH
    report = {
        "verdict": comparison.verdict, "exit_code": exit_code, "reasons": comparison.reasons,
        "settings": settings,
        "devices": old_out.result.get("devices") or {},
        "versions": old_out.result.get("versions") or {},
        "weights_matched": _weights_summary(old_out.result, new_out.result),
        "old": _side(old_out, job.detections[0]), "new": _side(new_out, job.detections[1]),
        "comparison": comparison.to_dict(), "notes": notes,
    }
    report["throughput"] = comparison.throughput
    report["final_loss"] = comparison.final
    return report, comparison


def _in_order_note(shuffles_off: List[list]) -> str:
    """What each run read in order instead of shuffling, as one note."""
    return _turned_off_note("input read in order in both runs (--keep-shuffles runs the shuffles: a queue's and "
                            "tf.data's draw from different random streams); shuffling turned off", shuffles_off)


def _turned_off_note(what: str, turned_off: List[list]) -> str:
    """``what``, then what each run turned off: `... in OLD Dropout(rate=0.3) ×2; in NEW ...`."""
    sides = []
    for label, calls in zip(("OLD", "NEW"), turned_off):
        counts = Counter(calls)
        listed = ", ".join(call + (f" ×{n}" if n > 1 else "") for call, n in counts.items()) or "nothing"
        sides.append(f"{label} {listed}")
    return f"{what} in " + "; in ".join(sides)


def _write_outputs(job: _Job, report: dict, comparison) -> None:
    """Print the verdict (or the full report), then write the JSON and the plot when asked."""
    out = job.out
    if job.quiet:
        out.print(f"{comparison.verdict.upper()}" + (": " + "; ".join(comparison.reasons) if comparison.reasons else ""),
                  highlight=False, markup=False)
    else:
        from tfmigrate.verify.report import render

        render(out, report, comparison)
    if job.json_path:
        from tfmigrate.verify.report import write_json

        write_json(Path(job.json_path), report)
    if job.plot_path:
        from tfmigrate.verify.report import write_plot

        write_plot(Path(job.plot_path), report, comparison)


def register(app: typer.Typer) -> None:
    app.command(
        "verify",
        context_settings={"allow_interspersed_args": True},
        help="Train OLD and NEW side by side on K devices and compare loss per step and throughput. "
             "Exit 0 when they match, 1 when they differ, 2 when a program could not run.",
    )(verify)
