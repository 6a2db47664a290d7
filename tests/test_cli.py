"""The `check` command end to end: discovery, config, suppressions, bad input, output formats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfmigrate.cli.main import app

TOWER = textwrap.dedent(
    """\
    import tensorflow as tf

    for i in range(2):
        with tf.device('/gpu:%d' % i):
            out = model(x)
    """
)


def write(root: Path, name: str, text: str | bytes) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def run(args: list[str], cwd: Path, stdin: str | None = None):
    runner = CliRunner()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(app, args, input=stdin, catch_exceptions=False)
    finally:
        os.chdir(old)


def json_check(args: list[str], cwd: Path):
    result = run(["check", "--format", "json", *args], cwd)
    return result.exit_code, json.loads(result.stdout)


def test_clean_tree_exits_zero(tmp_path):
    write(tmp_path, "ok.py", "import tensorflow as tf\nstrategy = tf.distribute.MirroredStrategy()\n")
    result = run(["check", "."], tmp_path)
    assert result.exit_code == 0
    assert "All checks passed" in result.stdout


def test_finding_exits_one_and_shows_location_and_source(tmp_path):
    write(tmp_path, "train.py", TOWER)
    result = run(["check", "train.py"], tmp_path)
    assert result.exit_code == 1
    assert "train.py:3:1: TFM101" in result.stdout
    assert "3 | for i in range(2):" in result.stdout
    assert "^^^" in result.stdout


def test_json_has_ruff_shape(tmp_path):
    write(tmp_path, "train.py", TOWER)
    code, data = json_check(["train.py"], tmp_path)
    assert code == 1
    (item,) = data
    assert item["code"] == "TFM101"
    assert item["filename"] == str(tmp_path / "train.py")
    assert item["location"] == {"row": 3, "column": 1}
    assert item["end_location"] == {"row": 5, "column": 23}
    assert item["fix"]["applicability"] == "unsafe"  # the towers only compute: a replica function
    assert item["url"].endswith("#tfm101")
    assert set(item) >= {"code", "message", "filename", "location", "end_location", "fix", "url"}


def test_gitignore_and_exclude_are_honoured(tmp_path):
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nexclude = ["legacy/"]\n')
    write(tmp_path, ".gitignore", "generated/\n*_pb2.py\n")
    write(tmp_path, "src/a.py", TOWER)
    write(tmp_path, "generated/b.py", TOWER)
    write(tmp_path, "src/c_pb2.py", TOWER)
    write(tmp_path, "legacy/d.py", TOWER)
    _, data = json_check(["."], tmp_path)
    assert {Path(d["filename"]).name for d in data} == {"a.py"}
    # A file named explicitly is checked unless --force-exclude (what pre-commit passes).
    _, data = json_check(["legacy/d.py"], tmp_path)
    assert len(data) == 1
    code, data = json_check(["--force-exclude", "legacy/d.py"], tmp_path)
    assert (code, data) == (0, [])


def test_select_ignore_and_per_file_ignores(tmp_path):
    write(tmp_path, "a.py", TOWER)
    write(tmp_path, "tests/b.py", TOWER)
    assert json_check(["--ignore", "TFM1", "."], tmp_path) == (0, [])
    assert len(json_check(["--select", "TFM101", "."], tmp_path)[1]) == 2
    assert json_check(["--select", "TFM3", "."], tmp_path) == (0, [])
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nper-file-ignores = { "tests/*" = ["TFM101"] }\n')
    _, data = json_check(["."], tmp_path)
    assert [Path(d["filename"]).name for d in data] == ["a.py"]
    # The most specific prefix wins, as in ruff: select TFM101 beats ignore TFM1.
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nignore = ["TFM1"]\nselect = ["TFM101"]\n')
    assert len(json_check(["."], tmp_path)[1]) == 2


def test_unknown_code_and_bad_config_are_usage_errors(tmp_path):
    write(tmp_path, "a.py", TOWER)
    result = run(["check", "--select", "XYZ9", "."], tmp_path)
    assert result.exit_code == 2 and "unknown rule code" in result.stderr
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nselct = ["TFM1"]\n')
    result = run(["check", "."], tmp_path)
    assert result.exit_code == 2 and "unknown [tool.tfmigrate] keys: selct" in result.stderr


def test_suppression_comments(tmp_path):
    suppressed = TOWER.replace("for i in range(2):", "for i in range(2):  # tfmigrate: ignore[TFM101]")
    write(tmp_path, "a.py", suppressed)
    assert json_check(["a.py"], tmp_path) == (0, [])
    write(tmp_path, "a.py", TOWER.replace("for i in range(2):", "for i in range(2):  # tfmigrate: ignore"))
    assert json_check(["a.py"], tmp_path) == (0, [])
    write(tmp_path, "a.py", TOWER.replace("for i in range(2):", "for i in range(2):  # tfmigrate: ignore[TFM3]"))
    assert len(json_check(["a.py"], tmp_path)[1]) == 1


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"import tensorflow as tf\nwith tf.device('/gpu:0'):\n    print 'hello'\n", "Python 2 syntax (print statement at line 3): run it through 2to3 first"),
        (b"import tensorflow as tf\ntry:\n    tf.device(x)\nexcept ValueError, e:\n    pass\n", "Python 2 syntax ('except E, e' clause at line 4)"),
        (b"import tensorflow as tf\nwith tf.device('/gpu:0')\n    x = 1\n", "syntax error at line 2"),
        (b"import tensorflow as tf\nx = '\xff\xfe device'\n", "cannot decode as utf-8 (line 2, byte 0xff)"),
    ],
    ids=["py2-print", "py2-except", "syntax", "undecodable"],
)
def test_bad_input_gets_one_line_error_and_the_run_goes_on(tmp_path, content, reason):
    write(tmp_path, "bad.py", content)
    write(tmp_path, "good.py", TOWER)
    write(tmp_path, "empty.py", "")
    result = run(["check", "--format", "json", "."], tmp_path)
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(os.path.join(".", "bad.py").lstrip("./") ) or "bad.py: error:" in errors[0]
    assert reason in errors[0]
    data = json.loads(result.stdout)
    assert [d["code"] for d in data if d["code"]] == ["TFM101"]  # good.py was still checked
    assert (tmp_path / "bad.py").read_bytes() == content


def test_missing_path_is_an_error_but_others_are_checked(tmp_path):
    write(tmp_path, "good.py", TOWER)
    result = run(["check", "nothere.py", "good.py"], tmp_path)
    assert result.exit_code == 2
    assert "nothere.py: error: no such file or directory" in result.stderr
    assert "TFM101" in result.stdout


def test_github_and_sarif_and_statistics(tmp_path):
    write(tmp_path, "a.py", TOWER)
    result = run(["check", "--format", "github", "a.py"], tmp_path)
    assert result.stdout.startswith("::error title=tfmigrate (TFM101),file=a.py,line=3,col=1,endLine=5,endColumn=23::TFM101 ")
    result = run(["check", "--format", "sarif", "a.py"], tmp_path)
    sarif = json.loads(result.stdout)
    assert sarif["version"] == "2.1.0"
    run0 = sarif["runs"][0]
    rule_ids = [r["id"] for r in run0["tool"]["driver"]["rules"]]
    (res,) = run0["results"]
    assert res["ruleId"] == "TFM101" and rule_ids[res["ruleIndex"]] == "TFM101"
    region = res["locations"][0]["physicalLocation"]["region"]
    assert (region["startLine"], region["startColumn"], region["endLine"]) == (3, 1, 5)
    write(tmp_path, "b.py", TOWER + TOWER.split("\n", 1)[1])
    result = run(["check", "--statistics", "."], tmp_path)
    assert result.exit_code == 1
    row = [line.split() for line in result.stdout.splitlines() if "TFM101" in line][0]
    assert row[:3] == ["3", "TFM101", "manual-tower-loop"]


def test_quiet_prints_findings_only(tmp_path):
    write(tmp_path, "a.py", TOWER)
    result = run(["check", "-q", "a.py"], tmp_path)
    assert result.stdout.strip().splitlines() == [result.stdout.strip().splitlines()[0]]
    assert result.stdout.startswith("a.py:3:1: TFM101")


def test_rules_and_explain(tmp_path):
    result = run(["rules", "--format", "json"], tmp_path)
    codes = [r["code"] for r in json.loads(result.stdout)]
    assert "TFM101" in codes and codes == sorted(codes)
    result = run(["explain", "TFM101"], tmp_path)
    assert result.exit_code == 0
    assert "## Use instead" in result.stdout and "MirroredStrategy" in result.stdout
    assert run(["explain", "manual-tower-loop"], tmp_path).exit_code == 0
    assert run(["explain", "TFM999"], tmp_path).exit_code == 2


def test_check_never_imports_tensorflow(tmp_path):
    write(tmp_path, "a.py", TOWER)
    probe = (
        "import sys\n"
        "from tfmigrate.cli.main import app\n"
        "from typer.testing import CliRunner\n"
        f"CliRunner().invoke(app, ['check', {str(tmp_path)!r}])\n"
        f"CliRunner().invoke(app, ['fix', {str(tmp_path)!r}])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras', 'numpy'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _console_script() -> str | None:
    candidate = Path(sys.executable).with_name("tfmigrate")
    return str(candidate) if candidate.exists() else shutil.which("tfmigrate")


def test_installed_console_script_json(tmp_path):
    script = _console_script()
    if script is None:
        pytest.skip("tfmigrate is not installed in this environment")
    write(tmp_path, "pkg/train.py", TOWER)
    write(tmp_path, "pkg/clean.py", "x = 1\n")
    out = subprocess.run([script, "check", "--format", "json", "pkg"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    (item,) = json.loads(out.stdout)
    assert item["code"] == "TFM101" and item["name"] == "manual-tower-loop"
    assert item["filename"] == str(tmp_path / "pkg" / "train.py")
    assert item["location"] == {"row": 3, "column": 1}
    assert "MirroredStrategy" in item["message"]
    module = subprocess.run([sys.executable, "-m", "tfmigrate", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert module.stdout.startswith("tfmigrate ")


def test_worker_processes_give_the_same_output_in_the_same_order(tmp_path):
    for i in range(50):  # above the threshold for a worker pool
        write(tmp_path, f"pkg/m{i:02}.py", TOWER if i % 4 else "x = 1\n")
    write(tmp_path, "pkg/zz_bad.py", "import tensorflow as tf\nwith tf.device('/gpu:0')\n    x = 1\n")
    serial = run(["check", "--no-cache", "--jobs", "1", "--format", "json", "."], tmp_path)
    parallel = run(["check", "--no-cache", "--jobs", "2", "--format", "json", "."], tmp_path)
    assert serial.exit_code == parallel.exit_code == 2
    assert serial.stdout == parallel.stdout and serial.stderr == parallel.stderr
    assert len(json.loads(parallel.stdout)) == 38
    assert run(["check", "--jobs", "0", "."], tmp_path).exit_code == 2


def test_summary_counts_safe_and_unsafe_fixes_in_words():
    from tfmigrate.findings import Finding, FixSafety, Location
    from tfmigrate.engine.reporters import summary_line

    def finding(safety, title="fix it"):
        return Finding("TFM101", "n", "m", "a.py", Location(1, 1), Location(1, 2), safety, fix_title=title)

    only_unsafe = summary_line([finding(FixSafety.UNSAFE), finding(FixSafety.UNSAFE)], [], 1)
    assert only_unsafe == "Found 2 findings (1 file checked). 2 fixable with `tfmigrate fix --write --unsafe-fixes`."
    both = summary_line([finding(FixSafety.SAFE), finding(FixSafety.UNSAFE), finding(FixSafety.NONE, None)], [], 2)
    assert both == (
        "Found 3 findings (2 files checked). [*] 1 fixable with `tfmigrate fix --write`. "
        "1 more fixable with `tfmigrate fix --write --unsafe-fixes`."
    )


# --- issue 16: stdin, select, exit-zero, NO_COLOR, error locations -----------------------------
FIXABLE = "import tensorflow as tf\nit = dataset.make_one_shot_iterator()\n"  # a safe TFM305 fix
FIXED = "import tensorflow as tf\nit = tf.compat.v1.data.make_one_shot_iterator(dataset)\n"
UNPARSABLE = FIXABLE + "\n\ndef broken(:\n    pass\n"  # line 5, column 12


def _cli(args: list[str], cwd: Path, stdin: str | None = None, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfmigrate", *args], input=stdin, capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "TFMIGRATE_CACHE_DIR": str(cwd / ".cache"), **env},
    )


def test_check_reads_stdin_under_the_stdin_filename(tmp_path):
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nper-file-ignores = { "tests/*" = ["TFM305"] }\n')
    for args in (["check", "-", "--stdin-filename", "src/model.py"], ["check", "--stdin-filename", "src/model.py"]):
        result = _cli(args, tmp_path, FIXABLE)  # the fast path
        assert result.returncode == 1, result.stderr
        assert result.stdout.startswith("src/model.py:2:6: TFM305"), result.stdout
        assert "2 | it = dataset.make_one_shot_iterator()" in result.stdout
    # Configured as the name says: per-file ignores apply; Typer's path answers the same.
    assert _cli(["check", "-", "--stdin-filename", "tests/t.py"], tmp_path, FIXABLE).returncode == 0
    outcome = run(["check", "--format", "json", "--stdin-filename", "src/model.py", "--jobs", "1", "-"], tmp_path, FIXABLE)
    [finding] = json.loads(outcome.stdout)
    assert finding["filename"] == str(tmp_path / "src" / "model.py") and finding["code"] == "TFM305"
    assert not (tmp_path / "src").exists()  # nothing written, nothing looked up on disk
    assert _cli(["check", "-"], tmp_path, FIXABLE).stdout.startswith("-:2:6: TFM305")
    mixed = _cli(["check", "-", "other.py"], tmp_path, FIXABLE)
    assert mixed.returncode == 2 and "cannot be mixed" in mixed.stderr


def test_fix_reads_stdin_and_writes_the_fixed_code_to_stdout(tmp_path):
    result = _cli(["fix", "-", "--stdin-filename", "model.py"], tmp_path, FIXABLE)
    assert result.returncode == 0 and result.stdout == FIXED, result.stderr
    assert "Fixed 1 finding" in result.stderr and not (tmp_path / "model.py").exists()
    # Nothing to fix, or a file that cannot be fixed: the input comes back as it was.
    assert _cli(["fix", "-"], tmp_path, "x = 1\n").stdout == "x = 1\n"
    broken = _cli(["fix", "-"], tmp_path, UNPARSABLE)
    assert broken.returncode == 2 and broken.stdout == UNPARSABLE and "-: error: syntax error" in broken.stderr
    # --format json reports what remains on stderr: stdout is the code.
    report = _cli(["fix", "-", "--format", "json", "--select", "TFM3"], tmp_path, FIXABLE)
    assert report.stdout == FIXED and json.JSONDecoder().raw_decode(report.stderr)[0] == []


def test_select_on_the_command_line_overrides_ignore_in_the_config(tmp_path):
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nignore = ["TFM305", "TFM1"]\n')
    write(tmp_path, "a.py", FIXABLE)
    assert json_check(["."], tmp_path) == (0, [])
    code, data = json_check(["--select", "TFM305", "."], tmp_path)
    assert code == 1 and [d["code"] for d in data] == ["TFM305"]
    assert _cli(["check", "--select", "TFM3", "."], tmp_path).returncode == 1  # the fast path too
    assert json_check(["--select", "TFM3", "--ignore", "TFM305", "."], tmp_path) == (0, [])  # --ignore still adds


def test_select_and_ignore_accept_rule_names(tmp_path):
    write(tmp_path, "a.py", FIXABLE + TOWER)
    code, data = json_check(["--select", "dataset-iterator", "."], tmp_path)
    assert code == 1 and {d["code"] for d in data} == {"TFM305"}
    code, data = json_check(["--select", "TFM", "--ignore", "Manual-Tower-Loop,dataset-iterator", "."], tmp_path)
    assert "TFM101" not in {d["code"] for d in data} and "TFM305" not in {d["code"] for d in data}
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nselect = ["manual-tower-loop"]\n')
    assert {d["code"] for d in json_check(["."], tmp_path)[1]} == {"TFM101"}
    bad = run(["check", "--select", "no-such-rule", "."], tmp_path)
    assert bad.exit_code == 2 and "unknown rule code" in bad.stderr


def test_exit_zero_also_covers_files_that_cannot_be_checked(tmp_path):
    write(tmp_path, "bad.py", UNPARSABLE)
    write(tmp_path, "good.py", FIXABLE)
    assert _cli(["check", "."], tmp_path).returncode == 2
    result = _cli(["check", "--exit-zero", "."], tmp_path)
    assert result.returncode == 0 and "bad.py: error: syntax error at line 5" in result.stderr
    assert run(["check", "--exit-zero", "--no-cache", "."], tmp_path).exit_code == 0
    assert run(["check", "--exit-zero", "--select", "XYZ9", "."], tmp_path).exit_code == 2  # usage errors stay


def test_fix_accepts_no_cache_format_statistics_and_exit_zero(tmp_path):
    write(tmp_path, "a.py", FIXABLE + TOWER)
    write(tmp_path, "bad.py", UNPARSABLE)
    result = run(["fix", "--no-cache", "--format", "json", "."], tmp_path)
    data = json.loads(result.stdout)  # the findings that remain after the fix, and the errors: no diff
    assert result.exit_code == 2 and "TFM101" in {d["code"] for d in data}
    [error] = [d for d in data if d["code"] is None]
    assert error["location"] == {"column": 12, "row": 5} and error["filename"].endswith("bad.py")
    result = run(["fix", "--statistics", "a.py"], tmp_path)
    assert result.exit_code == 1 and "TFM101" in result.stdout and "---" not in result.stdout
    assert run(["fix", "--exit-zero", "."], tmp_path).exit_code == 0
    assert run(["fix", "--format", "xml", "."], tmp_path).exit_code == 2
    assert (tmp_path / "a.py").read_text() == FIXABLE + TOWER  # no --write: nothing written


def test_json_github_and_sarif_give_the_line_of_a_parse_error(tmp_path):
    write(tmp_path, "bad.py", UNPARSABLE)
    code, data = json_check(["bad.py"], tmp_path)
    assert code == 2 and data[0]["location"] == {"column": 12, "row": 5} == data[0]["end_location"]
    github = run(["check", "--format", "github", "bad.py"], tmp_path).stdout
    assert "file=bad.py,line=5,col=12::syntax error" in github
    sarif = json.loads(run(["check", "--format", "sarif", "bad.py"], tmp_path).stdout)
    [note] = sarif["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert note["locations"][0]["physicalLocation"]["region"] == {"startLine": 5, "startColumn": 12}


def _on_a_terminal(args: list[str], cwd: Path, **env) -> bytes:
    """Everything the command writes to a pseudo-terminal (stdout and stderr both)."""
    import pty

    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "tfmigrate", *args], stdin=follower, stdout=follower, stderr=follower, cwd=cwd,
        env={**os.environ, "TFMIGRATE_CACHE_DIR": str(cwd / ".cache"), "COLUMNS": "120", **env},
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other side closed
            break
        if not chunk:
            break
        output += chunk
    process.wait()
    os.close(leader)
    return output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_no_color_writes_no_escape_code_on_a_terminal(tmp_path):
    for n in range(45):  # enough files for worker processes and a progress bar
        write(tmp_path, f"m{n:02}.py", FIXABLE)
    write(tmp_path, "bad.py", UNPARSABLE)
    commands = [
        ["check", "--no-cache", "."], ["check", "--statistics", "."], ["fix", "."], ["fix", "--write", "m00.py"],
        ["explain", "TFM101"], ["rules"], ["check", "--bogus"],
    ]
    colored = _on_a_terminal(["check", "--no-cache", "."], tmp_path, NO_COLOR="")
    assert b"\x1b[" in colored  # the test's terminal does get colour without NO_COLOR
    for args in commands:
        output = _on_a_terminal(args, tmp_path, NO_COLOR="1")
        assert output and b"\x1b" not in output, (args, output[:300])


def test_tower_input_chooses_what_the_tower_rewrite_does_with_fed_batches(tmp_path):
    """`keep` (the default): the session keeps feeding the placeholders each replica reads;
    `dataset` (pyproject or --tower-input): the feeds become a generator-backed tf.data
    pipeline distributed by the strategy. Anything else is a usage error naming the values."""
    program = Path(__file__).parent.parent / "fixtures" / "programs" / "towers_feed_dict.py"
    write(tmp_path, "a.py", program.read_text())
    keep = run(["fix", "--unsafe-fixes", "--diff", "a.py"], tmp_path)
    assert "call_for_each_replica(" in keep.stdout and "from_generator(" not in keep.stdout
    dataset = run(["fix", "--unsafe-fixes", "--diff", "--tower-input", "dataset", "a.py"], tmp_path)
    assert "from_generator(" in dataset.stdout and "strategy.run(" in dataset.stdout
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\ntower-input = "dataset"\n')
    assert run(["fix", "--unsafe-fixes", "--diff", "a.py"], tmp_path).stdout == dataset.stdout
    assert run(["fix", "--unsafe-fixes", "--diff", "--tower-input", "keep", "a.py"], tmp_path).stdout == keep.stdout
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\ntower-input = "queue"\n')
    result = run(["check", "."], tmp_path)
    assert result.exit_code == 2 and "tower-input must be one of keep, dataset" in result.stderr
    result = run(["fix", "--tower-input", "fed", "a.py"], tmp_path.parent)
    assert result.exit_code == 2 and "--tower-input must be one of keep, dataset" in result.stderr


def test_a_location_is_never_read_as_an_emoji_code(tmp_path):
    """`path:100:5:` holds `:100:`, rich's emoji code for 💯: a refusal on line 100 was printed
    as `path💯5:` (found by the mutation fuzz test)."""
    lines = ["# padding"] * 96 + [
        "import tensorflow as tf",
        "def towers(xs, n):",
        "    outs = []",
        "    for i in range(n):",
        "        with tf.device('/gpu:%d' % i):",
        "            outs.append(model(xs[i]))",
        "    return outs",
    ]
    (tmp_path / "towers.py").write_text("\n".join(lines) + "\n")
    result = run(["fix", "--unsafe-fixes", "--show-refusals", "--no-cache", "towers.py"], tmp_path)
    assert "towers.py:100:5: TFM101 no automatic fix:" in result.stderr, result.stderr
    assert "\U0001f4af" not in result.stderr


@pytest.mark.parametrize("command", [["check", "--no-cache"], ["fix", "--diff", "--unsafe-fixes", "--no-cache"]])
def test_a_reader_that_stops_early_ends_the_run_quietly(tmp_path, command):
    """`tfmigrate check src | head -3`: the pipe closes after three lines; the run stops with no
    traceback (it printed "BrokenPipeError" with one before)."""
    program = (Path(__file__).parent.parent / "fixtures" / "programs" / "general_staged_tower_loops.py").read_text()
    for n in range(40):
        (tmp_path / f"towers_{n}.py").write_text(program)
    process = subprocess.Popen([sys.executable, "-m", "tfmigrate", *command, str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    process.stdout.readline()
    process.stdout.close()  # the reader goes away
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
