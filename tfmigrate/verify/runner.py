"""Run one program under the harness in a subprocess (no TensorFlow in this process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tfmigrate.verify import preload


#: TensorFlow's C++ log lines (glog format) and absl's preamble: not the program's output
NOISE = re.compile(r"^([IWEF]\d{4} \S+\s+\d+ \S+:\d+\]|WARNING: All log messages before absl)")


@dataclass
class RunSpec:
    label: str                   # "OLD" or "NEW"
    program: Path
    legacy: bool
    keras: bool
    steps: int
    devices: int
    seed: int
    timeout: float
    workdir: Path
    dump_weights: Optional[Path] = None
    load_weights: Optional[Path] = None
    loss_regex: Optional[str] = None
    program_args: list = field(default_factory=list)
    keras2: bool = False         # TF1 layers through tf.compat.v1: run with Keras 2 (see detect.Detection)
    multi_gpu_tf2: bool = False  # a TF 2.0-2.3 Keras program: multi_gpu_model restored in TF2 (see detect.Detection)
    in_order: bool = False       # input pipelines read in order (see in_order.py)
    no_dropout: bool = False     # Keras dropout layers off (see no_dropout.py)


@dataclass
class RunOutcome:
    spec: RunSpec
    returncode: Optional[int]
    timed_out: bool
    seconds: float
    output: str                  # the program's stdout and stderr, interleaved
    result: Optional[dict]       # the harness's JSON, when it wrote one

    @property
    def ok(self) -> bool:
        return (not self.timed_out and self.result is not None and bool(self.result.get("ok"))
                and self.returncode == 0)

    def tail(self, lines: int = 25) -> str:
        """The last lines of the program's output, without TensorFlow's C++ start-up chatter."""
        text = [line for line in self.output.splitlines() if line.strip() and not NOISE.match(line)]
        return "\n".join(text[-lines:])

    def failure(self) -> str:
        """One line on why this run gave no measurements."""
        name = self.spec.program.name
        if self.timed_out:
            return f"{self.spec.label} {name} did not finish within --timeout {self.spec.timeout:g}s (killed)"
        if self.result is not None and self.result.get("error"):
            return f"{self.spec.label} {name} failed: {self.result['error']}"
        return f"{self.spec.label} {name} exited with status {self.returncode} before reporting"


def harness_command(spec: RunSpec, out: Path) -> list[str]:
    command = [sys.executable, "-m", "tfmigrate.verify.harness", "--out", str(out),
               "--steps", str(spec.steps), "--devices", str(spec.devices), "--seed", str(spec.seed)]
    if spec.legacy:
        command.append("--legacy")
    if spec.keras:
        command.append("--keras")
    if spec.keras2:
        command.append("--keras2")
    if spec.multi_gpu_tf2:
        command.append("--restore-multi-gpu-model")
    if spec.dump_weights:
        command += ["--dump-weights", str(spec.dump_weights)]
    if spec.load_weights:
        command += ["--load-weights", str(spec.load_weights)]
    if spec.loss_regex:
        command += ["--loss-regex", spec.loss_regex]
    if spec.in_order:
        command.append("--in-order")
    if spec.no_dropout:
        command.append("--no-dropout")
    command.append(str(spec.program))
    if spec.program_args:
        command += ["--", *spec.program_args]
    return command


def run_program(spec: RunSpec, on_tick: Optional[Callable[[float], None]] = None) -> RunOutcome:
    out = spec.workdir / f"{spec.label.lower()}.json"
    log = spec.workdir / f"{spec.label.lower()}.log"
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = str(spec.seed)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # oneDNN's CPU kernels are not exact: its fused batch normalization's gradient is 1e-5 off
    # TensorFlow's own (and Keras 3's unfused one), which an adaptive optimizer grew into a
    # MISMATCH of a correct migration from step 1. Both runs use TensorFlow's kernels, unless
    # the environment says otherwise.
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    timed_out = False
    command = harness_command(spec, out)
    with open(log, "wb") as handle:
        process = _start(command, log, handle, env, legacy_keras=spec.legacy or spec.keras2)
        try:
            while True:
                try:
                    process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if on_tick:
                        on_tick(elapsed)
                    if elapsed > spec.timeout:
                        timed_out = True
                        _kill(process)
                        break
        except BaseException:
            _kill(process)
            raise
    seconds = time.monotonic() - started
    output = log.read_text(errors="replace")
    result = None
    if out.exists() and not timed_out:
        try:
            result = json.loads(out.read_text())
        except json.JSONDecodeError:
            result = None
    return RunOutcome(spec, process.returncode, timed_out, seconds, output, result)


def _start(command: list, log: Path, handle, env: dict, legacy_keras: bool):
    """The harness run: forked from a preload server where one can run it, else a subprocess."""
    if legacy_keras:
        # the harness sets it before importing TensorFlow; the server's import must see it too
        env = dict(env, TF_USE_LEGACY_KERAS="1")
    if preload.enabled():
        forked = preload.start(command[3:], str(log), env)  # after `python -m tfmigrate.verify.harness`
        if forked is not None:
            return forked
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)


def _kill(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()
