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

from tfmigrate.cli import app

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


def run(args: list[str], cwd: Path):
    runner = CliRunner()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(app, args, catch_exceptions=False)
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
    assert item["fix"] is None
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
        "from tfmigrate.cli import app\n"
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
    from tfmigrate.reporters import summary_line

    def finding(safety, title="fix it"):
        return Finding("TFM101", "n", "m", "a.py", Location(1, 1), Location(1, 2), safety, fix_title=title)

    only_unsafe = summary_line([finding(FixSafety.UNSAFE), finding(FixSafety.UNSAFE)], [], 1)
    assert only_unsafe == "Found 2 findings (1 file checked). 2 fixable with `tfmigrate fix --write --unsafe-fixes`."
    both = summary_line([finding(FixSafety.SAFE), finding(FixSafety.UNSAFE), finding(FixSafety.NONE, None)], [], 2)
    assert both == (
        "Found 3 findings (2 files checked). [*] 1 fixable with `tfmigrate fix --write`. "
        "1 more fixable with `tfmigrate fix --write --unsafe-fixes`."
    )
