"""Compare two measured runs: pure Python (no TensorFlow, no NumPy), so it is cheap to test.

Tolerance. A step's losses agree when ``|new - old| <= atol + rtol * |old|`` (NumPy's
``isclose`` with OLD as the reference). TensorFlow's migration guide ("Validate correctness and
numerical equivalence") compares a TF1 and a TF2 run with matched weights at rtol 1e-6 /
atol 1e-5, on one device. Across replicas the arithmetic is not the same arithmetic: a tower
loop averages per-tower *gradients* with ``reduce_mean`` while MirroredStrategy *sums* gradients
of losses pre-divided by the global batch, and the cross-device reduction adds in its own
order. Each step can therefore differ by a few float32 ulps (relative ~1e-7), and those
differences compound through training -- slowly for a sound model, faster for a large learning
rate or a deep network. Measured on the fixture pair (2 logical CPU devices, matched weights,
40 steps), the largest relative difference was ~1e-7; we default to ``rtol=1e-4`` and
``atol=1e-6``: three orders of magnitude above what a correct migration shows, and two orders
below the smallest error a real migration bug produces on the fixtures (a learning rate off by
10 % gives ~1e-2 at step 1; an unscaled replica loss gives 1.0 at step 0). Use ``--rtol`` to
loosen it for long runs or mixed precision.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6


@dataclass
class Throughput:
    examples_per_s: Optional[float]
    steps_per_s: Optional[float]
    measured_steps: int
    seconds: float
    median_step_s: Optional[float] = None          # robust to one slow step (an epoch boundary)
    median_examples_per_s: Optional[float] = None


@dataclass
class StepDiff:
    step: int
    old: Optional[float]
    new: Optional[float]
    abs_diff: Optional[float]
    rel_diff: Optional[float]
    ok: bool


@dataclass
class Comparison:
    verdict: str                       # "match" or "mismatch"
    reasons: list = field(default_factory=list)
    steps_compared: int = 0
    per_step: list = field(default_factory=list)
    max_rel_diff: Optional[float] = None
    max_abs_diff: Optional[float] = None
    worst_step: Optional[int] = None
    first_bad_step: Optional[int] = None
    final: dict = field(default_factory=dict)
    throughput: dict = field(default_factory=dict)
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL

    def to_dict(self) -> dict:
        return asdict(self)


def close(old: Optional[float], new: Optional[float], rtol: float, atol: float) -> bool:
    if old is None or new is None:
        return False
    if math.isnan(old) or math.isnan(new) or math.isinf(old) or math.isinf(new):
        return False
    return abs(new - old) <= atol + rtol * abs(old)


def throughput(steps: Sequence[dict], warmup: int) -> Throughput:
    """Examples (and steps) per second over the steps after ``warmup``.

    The window runs from the end of step ``warmup - 1`` (or the start of step 0 when
    ``warmup`` is 0) to the end of the last step, so the time the program spends between
    training runs -- feeding numpy batches, for instance -- counts: it is part of its speed.
    """
    if len(steps) <= warmup or not steps:
        return Throughput(None, None, 0, 0.0)
    window = steps[warmup:]
    begin = steps[warmup - 1]["t_end"] if warmup > 0 else steps[0]["t_start"]
    seconds = steps[-1]["t_end"] - begin
    if seconds <= 0:
        return Throughput(None, None, len(window), seconds)
    examples = [s.get("examples") for s in window]
    rate = sum(examples) / seconds if all(e for e in examples) else None
    ends = [begin] + [s["t_end"] for s in window]
    median = statistics.median(later - earlier for earlier, later in zip(ends, ends[1:]))
    median_rate = None
    if rate is not None and median > 0:
        median_rate = statistics.median(examples) / median
    return Throughput(rate, len(window) / seconds, len(window), seconds, median, median_rate)


def compare(
    old_steps: Sequence[dict], new_steps: Sequence[dict], *, rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL, warmup: int = 0,
) -> Comparison:
    """Step-by-step comparison of two runs' ``[{"loss": float, "examples": int, "t_start", "t_end"}]``."""
    result = Comparison(verdict="match", rtol=rtol, atol=atol)
    count = min(len(old_steps), len(new_steps))
    if len(old_steps) != len(new_steps):
        result.reasons.append(f"step counts differ: OLD ran {len(old_steps)} steps, NEW ran {len(new_steps)}")
    if count == 0:
        result.reasons.append("no steps to compare")
    for index in range(count):
        old, new = old_steps[index].get("loss"), new_steps[index].get("loss")
        ok = close(old, new, rtol, atol)
        abs_diff = rel_diff = None
        if old is not None and new is not None:
            abs_diff = abs(new - old)
            rel_diff = abs_diff / abs(old) if old else (0.0 if new == old else math.inf)
        result.per_step.append(StepDiff(index, old, new, abs_diff, rel_diff, ok))
        if rel_diff is not None and not math.isnan(rel_diff) and (
                result.max_rel_diff is None or rel_diff > result.max_rel_diff):
            result.max_rel_diff, result.worst_step = rel_diff, index
        if abs_diff is not None and not math.isnan(abs_diff) and (
                result.max_abs_diff is None or abs_diff > result.max_abs_diff):
            result.max_abs_diff = abs_diff
        if not ok and result.first_bad_step is None:
            result.first_bad_step = index
    result.steps_compared = count
    bad = [d for d in result.per_step if not d.ok]
    if bad:
        first = bad[0]
        result.reasons.append(
            f"{len(bad)} of {count} steps differ beyond rtol={rtol:g}, atol={atol:g}; first at step "
            f"{first.step}: OLD {_fmt(first.old)} vs NEW {_fmt(first.new)}")
    if count:
        last = result.per_step[-1]
        result.final = {"step": last.step, "old": last.old, "new": last.new, "rel_diff": last.rel_diff,
                        "ok": last.ok}
    old_rate, new_rate = throughput(old_steps, warmup), throughput(new_steps, warmup)
    ratio = None
    if old_rate.examples_per_s and new_rate.examples_per_s:
        ratio = new_rate.examples_per_s / old_rate.examples_per_s
    elif old_rate.steps_per_s and new_rate.steps_per_s:
        ratio = new_rate.steps_per_s / old_rate.steps_per_s
    median_ratio = None
    if old_rate.median_examples_per_s and new_rate.median_examples_per_s:
        median_ratio = new_rate.median_examples_per_s / old_rate.median_examples_per_s
    result.throughput = {"old": asdict(old_rate), "new": asdict(new_rate), "ratio": ratio,
                         "median_step_ratio": median_ratio,
                         "basis": "examples" if old_rate.examples_per_s and new_rate.examples_per_s else "steps",
                         "warmup": warmup}
    if result.reasons:
        result.verdict = "mismatch"
    return result


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.6g}"
