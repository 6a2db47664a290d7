"""The verify report: a rich table on the terminal, a JSON file, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from tfmigrate.verify.compare import Comparison

MAX_ROWS = 24


def _num(value: Optional[float], spec: str = ".6g") -> str:
    return "—" if value is None else format(value, spec)


def _rate(rate: dict) -> str:
    if rate.get("examples_per_s"):
        return f"{rate['examples_per_s']:,.0f} ex/s"
    if rate.get("steps_per_s"):
        return f"{rate['steps_per_s']:,.1f} steps/s"
    return "—"


def _rows(count: int, worst: Optional[int], first_bad: Optional[int]) -> list[int]:
    if count <= MAX_ROWS:
        return list(range(count))
    keep = set(range(8)) | set(range(count - 6, count))
    for centre in (worst, first_bad):
        if centre is not None:
            keep |= {i for i in range(centre - 2, centre + 3) if 0 <= i < count}
    return sorted(keep)


def render(console: Console, report: dict, comparison: Comparison) -> None:
    old, new = report["old"], report["new"]
    table = Table(title="loss per training step", header_style="bold", box=None)
    table.add_column("step", justify="right")
    table.add_column("OLD", justify="right")
    table.add_column("NEW", justify="right")
    table.add_column("rel diff", justify="right")
    table.add_column("", justify="left")
    previous = -1
    for index in _rows(comparison.steps_compared, comparison.worst_step, comparison.first_bad_step):
        if index != previous + 1:
            table.add_row("…", "", "", "", "")
        diff = comparison.per_step[index]
        mark = "[green]ok[/]" if diff.ok else "[red]differs[/]"
        table.add_row(str(diff.step), _num(diff.old), _num(diff.new), _num(diff.rel_diff, ".2e"), mark)
        previous = index
    console.print(table)

    summary = Table(header_style="bold", box=None, title="summary")
    summary.add_column("")
    summary.add_column("OLD")
    summary.add_column("NEW")
    summary.add_row("program", Path(old["program"]).name, Path(new["program"]).name)
    summary.add_row("mode", old["mode"], new["mode"])
    summary.add_row("loss from", old.get("loss_source") or "—", new.get("loss_source") or "—")
    summary.add_row("steps", str(len(old["steps"])), str(len(new["steps"])))
    final = comparison.final
    summary.add_row("final loss", _num(final.get("old")), _num(final.get("new")))
    tp = comparison.throughput
    summary.add_row(f"throughput (after {tp['warmup']} warm-up)", _rate(tp["old"]), _rate(tp["new"]))
    console.print(summary)
    devices = report["devices"]
    weights = report["weights_matched"]
    console.print(
        f"devices: {devices.get('count')} × {devices.get('kind')} ({', '.join(devices.get('names', []))}); "
        f"weights: {weights['summary']}", highlight=False)
    if tp.get("ratio") is not None:
        median = tp.get("median_step_ratio")
        console.print(f"throughput NEW/OLD: {tp['ratio']:.2f}× ({tp['basis']}/s over the measured window)"
                      + (f"; {median:.2f}× by median step time" if median else ""), highlight=False)
    console.print(
        f"max relative difference: {_num(comparison.max_rel_diff, '.2e')}"
        + (f" at step {comparison.worst_step}" if comparison.worst_step is not None else "")
        + f" (tolerance rtol={comparison.rtol:g}, atol={comparison.atol:g})", highlight=False)
    for note in report.get("notes", []):
        console.print(f"note: {note}", highlight=False, markup=False)
    if comparison.verdict == "match":
        console.print(f"[bold green]MATCH[/]: {comparison.steps_compared} steps agree within tolerance")
    else:
        console.print("[bold red]MISMATCH[/]: " + "; ".join(comparison.reasons), highlight=False)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def write_plot(path: Path, report: dict, comparison: Comparison) -> None:
    """Both loss curves (left) and throughput bars (right), written with matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    for key, style in (("old", "-o"), ("new", "--x")):
        steps = report[key]["steps"]
        xs = [s["step"] for s in steps if s.get("loss") is not None]
        ys = [s["loss"] for s in steps if s.get("loss") is not None]
        curves.plot(xs, ys, style, markersize=3, label=f"{key.upper()} {Path(report[key]['program']).name}")
    curves.set_xlabel("training step")
    curves.set_ylabel("loss")
    curves.set_title(f"loss: {comparison.verdict} (max rel diff {_num(comparison.max_rel_diff, '.1e')})")
    curves.legend(fontsize=8)
    curves.grid(alpha=0.3)
    tp = comparison.throughput
    basis = "examples_per_s" if tp.get("basis") == "examples" else "steps_per_s"
    values = [tp["old"].get(basis) or 0.0, tp["new"].get(basis) or 0.0]
    bars.bar(["OLD", "NEW"], values, color=["#888888", "#2a7ab0"])
    bars.set_title("throughput" + (f"\nNEW/OLD {tp['ratio']:.2f}×" if tp.get("ratio") else ""), fontsize=10)
    bars.set_ylabel("examples/s" if basis == "examples_per_s" else "steps/s")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
