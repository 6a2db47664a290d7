"""The content-hash cache of `check` results (.tfmigrate_cache/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tfmigrate.cli.main
from tfmigrate.engine.cache import ENV_VAR

from .test_cli import TOWER, run, write
from .test_general_rewrite import PROJECT_TRAINER

BAD = "import tensorflow as tf\nwith tf.device('/gpu:0')\n    x = 1\n"


def tree(root: Path, files: int = 3) -> None:
    for i in range(files):
        write(root, f"pkg/m{i}.py", TOWER.replace("model(x)", f"model_{i}(x)"))
    write(root, "pkg/clean.py", "import os\nprint(os.getcwd())\n")
    write(root, "pkg/bad.py", BAD)


def check_json(root: Path, *args: str):
    result = run(["check", "--format", "json", *args, "."], root)
    return result.exit_code, json.loads(result.stdout), result.stderr


def packs(root: Path) -> list[Path]:
    return sorted(root.rglob("packs/*.json"))


def entries(root: Path, cache: str = ".tfmigrate_cache") -> list[str]:
    """The source files the cache holds a result for."""
    found = []
    for pack in packs(root / cache):
        data = json.loads(pack.read_text())
        found += [os.path.join(data["folder"], name) for name in data["files"]]
    return sorted(found)


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def count_checks(monkeypatch):
    """How many files `check` really analysed (cache misses)."""
    calls = []
    real = tfmigrate.cli.main.check_file

    def counting(path, config):
        calls.append(path)
        return real(path, config)

    monkeypatch.setattr(tfmigrate.cli.main, "check_file", counting)
    return calls


def test_warm_run_gives_identical_results_without_checking_anything(tmp_path, count_checks):
    tree(tmp_path)
    cold = check_json(tmp_path)
    assert cold[0] == 2 and len(count_checks) == 5  # bad.py is an error
    assert len(entries(tmp_path)) == 5  # the syntax error is cached too
    cache = tmp_path / ".tfmigrate_cache"
    assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert (cache / ".gitignore").read_text().splitlines()[-1] == "*"
    count_checks.clear()
    warm = check_json(tmp_path)
    assert warm == cold and count_checks == []
    text = run(["check", "."], tmp_path)
    assert "pkg/m0.py:3:1: TFM101" in text.stdout and "3 | for i in range(2):" in text.stdout


def test_changed_file_is_checked_again(tmp_path, count_checks):
    tree(tmp_path)
    check_json(tmp_path)
    count_checks.clear()
    write(tmp_path, "pkg/m1.py", "x = 1\n")
    write(tmp_path, "pkg/bad.py", TOWER)
    code, data, stderr = check_json(tmp_path)
    assert sorted(count_checks) == [os.path.join("pkg", "bad.py"), os.path.join("pkg", "m1.py")]
    assert code == 1 and "error" not in stderr
    assert sorted(Path(d["filename"]).name for d in data) == ["bad.py", "m0.py", "m2.py"]


def test_changed_config_is_checked_again(tmp_path, count_checks):
    tree(tmp_path, files=1)
    check_json(tmp_path)
    count_checks.clear()
    code, data, _ = check_json(tmp_path, "--ignore", "TFM101")
    assert len(count_checks) == 3 and [d["code"] for d in data] == [None]  # only bad.py's error
    count_checks.clear()
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nper-file-ignores = { "pkg/m0.py" = ["TFM1"] }\n')
    check_json(tmp_path)
    assert count_checks == [os.path.join("pkg", "m0.py")]  # the other files' ignores did not change
    count_checks.clear()
    check_json(tmp_path, "--target", "tf2")
    assert len(count_checks) == 3


@pytest.mark.parametrize("cut", [0, 10, 200, -2])
def test_corrupt_or_partial_packs_are_recomputed(tmp_path, count_checks, cut):
    tree(tmp_path)
    cold = check_json(tmp_path)
    [pack] = packs(tmp_path / ".tfmigrate_cache")
    pack.write_bytes(pack.read_bytes()[:cut])  # empty, truncated...
    count_checks.clear()
    assert check_json(tmp_path) == cold
    assert len(count_checks) == 5
    count_checks.clear()
    assert check_json(tmp_path) == cold and count_checks == []  # and rewritten whole


def test_a_damaged_entry_is_recomputed_alone(tmp_path, count_checks):
    tree(tmp_path)
    cold = check_json(tmp_path)
    [pack] = packs(tmp_path / ".tfmigrate_cache")
    data = json.loads(pack.read_text())
    [result] = data["files"]["m1.py"]["results"].values()
    result["findings"] = [{"code": 3}]
    data["files"]["m2.py"] = "nonsense"
    pack.write_text(json.dumps(data))
    count_checks.clear()
    assert check_json(tmp_path) == cold
    assert sorted(count_checks) == [os.path.join("pkg", "m1.py"), os.path.join("pkg", "m2.py")]


def _age(root: Path, seconds: int) -> None:
    """Make every file under ``root`` look last modified ``seconds`` ago."""
    past = time.time() - seconds
    for path in root.rglob("*.py"):
        os.utime(path, (past, past))


@pytest.fixture
def hashed(monkeypatch):
    """The files whose content the cache hashed."""
    import tfmigrate.engine.cache

    calls = []
    real = tfmigrate.engine.cache.content_digest
    monkeypatch.setattr(tfmigrate.engine.cache, "content_digest", lambda raw: calls.append(raw) or real(raw))
    return calls


def test_unchanged_old_files_are_not_even_read(tmp_path, count_checks, hashed, monkeypatch):
    tree(tmp_path)
    _age(tmp_path, 3600)
    time.sleep(0.01)  # the change times of the files must be older than the racy window too
    monkeypatch.setattr("tfmigrate.engine.cache._RACY_NS", 1)
    cold = check_json(tmp_path)
    hashed.clear()
    count_checks.clear()
    assert check_json(tmp_path) == cold and count_checks == [] and hashed == []


def test_a_file_rewritten_with_its_old_size_and_time_is_checked_again(tmp_path, count_checks, monkeypatch):
    tree(tmp_path)
    _age(tmp_path, 3600)
    time.sleep(0.01)
    monkeypatch.setattr("tfmigrate.engine.cache._RACY_NS", 1)
    check_json(tmp_path)
    target = tmp_path / "pkg" / "m0.py"
    info = target.stat()
    text = target.read_text()
    target.write_text(text.replace("range(2)", "range(3)"))  # same size
    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))  # and the same modification time
    count_checks.clear()
    check_json(tmp_path)
    assert count_checks == [os.path.join("pkg", "m0.py")]


def test_recently_modified_files_are_hashed_not_trusted_by_time(tmp_path, count_checks, hashed):
    tree(tmp_path)  # just written: within the racy window
    cold = check_json(tmp_path)
    hashed.clear()
    count_checks.clear()
    assert check_json(tmp_path) == cold and count_checks == [] and len(hashed) == 5


def test_no_cache_and_env_override(tmp_path, monkeypatch, count_checks):
    tree(tmp_path, files=1)
    check_json(tmp_path, "--no-cache")
    assert not (tmp_path / ".tfmigrate_cache").exists()
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv(ENV_VAR, str(elsewhere))
    check_json(tmp_path)
    assert not (tmp_path / ".tfmigrate_cache").exists()
    assert (elsewhere / "CACHEDIR.TAG").exists() and list(elsewhere.rglob("*.json"))


def test_unwritable_cache_folder_does_not_fail_the_run(tmp_path, monkeypatch):
    tree(tmp_path, files=1)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "pkg" / "clean.py" / "sub"))  # below a file: cannot exist
    code, data, stderr = check_json(tmp_path)
    assert code == 2 and [d["code"] for d in data] == ["TFM101", None] and "cache" not in stderr


def test_two_concurrent_runs_share_the_cache(tmp_path):
    for i in range(60):  # enough files for worker processes too
        write(tmp_path, f"pkg/m{i:02}.py", TOWER if i % 3 else "x = 1\n")
    command = [sys.executable, "-m", "tfmigrate", "check", "--format", "json", "."]
    expected = subprocess.run(command + ["--no-cache"], cwd=tmp_path, capture_output=True, text=True).stdout
    env = {**os.environ, ENV_VAR: str(tmp_path / "shared")}
    for _ in range(2):  # first both cold, then both warm
        runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        outputs = [p.communicate()[0] for p in runs]
        assert [p.returncode for p in runs] == [1, 1]
        assert outputs == [expected, expected]
    assert len(entries(tmp_path, "shared")) == 60
    for pack in packs(tmp_path / "shared"):
        for stored in json.loads(pack.read_text())["files"].values():
            assert len(stored["digest"]) == 64 and [len(key) for key in stored["results"]] == [64]
    assert not list((tmp_path / "shared").rglob("*.tmp"))


# --- start-up: what a run served from the cache does not load --------------------------------
PROBE = (
    "import sys\n"
    "sys.argv = ['tfmigrate', 'check', '--quiet', '.']\n"
    "from tfmigrate.cli.main import main\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as exc:\n"
    "    status = exc.code\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('libcst', 'typer', 'pydantic', 'rich')"
    " or m.startswith('tfmigrate.rules'))\n"
    "print(status, heavy, file=sys.stderr)\n"
)


def test_warm_run_imports_neither_libcst_nor_rules_nor_typer_nor_rich(tmp_path):
    tree(tmp_path)
    env = {**os.environ, ENV_VAR: str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert first.stderr.strip().splitlines()[-1].startswith("2 [")  # bad.py: exit 2
    assert "libcst" in first.stderr  # cold: the files were parsed
    warm = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert warm.stderr.strip().splitlines()[-1] == "2 []"
    assert warm.stdout == first.stdout and "TFM101" in warm.stdout
    # The catalog lives next to the entries, under the engine fingerprint.
    assert len(list((tmp_path / "cache").rglob("rules.catalog"))) == 1


def test_a_changed_file_imports_only_the_rules_it_could_trigger(tmp_path):
    """With the catalog in the cache folder, a file that needs parsing (the pre-commit case)
    imports only the rules whose trigger words it has."""
    tree(tmp_path, files=1)
    env = {**os.environ, ENV_VAR: str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    from tfmigrate.engine.registry import all_rules, could_fire

    text = "from keras.utils import multi_gpu_model\nparallel = multi_gpu_model(m, gpus=2)\n"
    write(tmp_path, "pkg/keras_model.py", text)
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    status, heavy = run.stderr.strip().splitlines()[-1].split(" ", 1)
    loaded = {name for name in eval(heavy) if name.startswith("tfmigrate.rules.")}  # noqa: S307 (our own repr)
    expected = {rule.__module__ for rule in all_rules() if could_fire(rule, text)}
    assert loaded == expected and "tfmigrate.rules.tfm201_multi_gpu_model" in loaded and len(loaded) < 8
    assert "TFM201" in run.stdout


def test_fast_path_and_typer_give_the_same_output(tmp_path):
    tree(tmp_path)
    write(tmp_path, "pyproject.toml", '[tool.tfmigrate]\nper-file-ignores = { "pkg/m0.py" = ["TFM1"] }\n')
    script = [sys.executable, "-m", "tfmigrate"]
    for args in (
        ["check", "--no-cache", "."],
        ["check", "--no-cache", "--format=json", "pkg", "--select", "TFM1", "--ignore", "TFM103"],
        ["check", "--no-cache", "-q", "--statistics", "--exit-zero", "--jobs", "1", "--", "pkg"],
        ["check", "--no-cache", "--no-show-source", "--target", "tf2", "--format", "sarif", "."],
        ["check", "--no-cache", "--select", "TFM999", "."],  # a usage error
        ["check", "--no-cache", "missing.py"],
    ):
        fast = subprocess.run(script + args, cwd=tmp_path, capture_output=True, text=True)
        typer_run = run(args, tmp_path)
        assert (fast.returncode, fast.stdout) == (typer_run.exit_code, typer_run.stdout), args


def test_fast_walk_calls_the_rules_like_libcst(tmp_path):
    """The runner's own walk calls visit_/leave_ methods on the same nodes in the same order
    as LibCST's ``module.visit`` (which rebuilds every node it passes)."""
    import libcst as cst

    from tfmigrate.rule import RuleContext
    from tfmigrate.engine.runner import _batched, _walk_rules

    node_types = [n for n in dir(cst) if isinstance(getattr(cst, n), type) and issubclass(getattr(cst, n), cst.CSTNode)]

    def recorder(types):
        def method(kind, name):
            return lambda self, node: self.log.append((kind, name, id(node)))

        namespace = {}
        for name in types:
            namespace["visit_" + name] = method("visit", name)
            namespace["leave_" + name] = method("leave", name)
        return type("Recorder", (cst.BatchableCSTVisitor,), namespace)

    everything = recorder(node_types)  # whitespace too: nothing skipped
    some = recorder(["Call", "Name", "Attribute", "For", "With", "FunctionDef", "Decorator", "IfExp", "Lambda"])
    root = Path(__file__).resolve().parent.parent
    sources = sorted((root / "fixtures").rglob("*.py")) + sorted((root / "tfmigrate").glob("*.py"))
    assert sources
    for path in sources:
        try:
            module = cst.parse_module(path.read_text(encoding="utf-8"))
        except cst.ParserSyntaxError:
            continue
        for visitor_class in (everything, some):
            expected, got = visitor_class(), visitor_class()
            expected.log, got.log = [], []
            module.visit(_batched([expected]))
            _walk_rules(module, [got], {}, {}, set(), RuleContext(path="<test>", module=module, imports=None))
            assert got.log == expected.log, path


def test_read_only_visit_matches_libcst_and_honours_false():
    """``visit_read_only`` calls a plain visitor like ``module.visit`` does, and a visit_X
    returning False keeps it out of that node's children, as in LibCST."""
    import libcst as cst

    from tfmigrate.cst.walker import visit_read_only

    class Log(cst.CSTVisitor):
        def __init__(self) -> None:
            super().__init__()
            self.log: list = []

        def visit_Name(self, node) -> None:
            self.log.append(("name", node.value))

        def visit_Call(self, node) -> None:
            self.log.append(("call", id(node)))

        def visit_Lambda(self, node) -> bool:
            self.log.append(("lambda", id(node)))
            return False  # names inside a lambda are not logged

        def leave_Call(self, node) -> None:
            self.log.append(("left", id(node)))

    class Hook(cst.CSTVisitor):
        def visit_Call_func(self, node) -> None:
            pass

    root = Path(__file__).resolve().parent.parent
    module = cst.parse_module((root / "fixtures" / "programs" / "towers_cifar.py").read_text()
                              + "\nf = lambda inside_lambda: inside_lambda + 1\n")
    expected, got = Log(), Log()
    module.visit(expected)
    visit_read_only(module, got)
    assert got.log == expected.log
    assert ("name", "inside_lambda") not in got.log and any(kind == "lambda" for kind, _ in got.log)
    with pytest.raises(TypeError, match="visit_Call_func"):
        visit_read_only(module, Hook())


def test_visitor_method_names_are_those_dir_finds():
    """The methods of a visitor class, read from its own classes only, are what ``dir()`` over
    the whole hierarchy (LibCST's hundreds of no-op stubs included) finds."""
    import libcst as cst

    import tfmigrate.cst.names
    import tfmigrate.rewrites.pipelines
    from tfmigrate.engine.registry import all_rules
    from tfmigrate.cst.walker import visitor_method_names

    def by_dir(cls):
        return tuple(
            name for name in dir(cls)
            if name.startswith(("visit_", "leave_")) and callable(getattr(cls, name))
            and not getattr(getattr(cls, name), "_is_no_op", False)
        )

    class Hooked(cst.CSTVisitor):
        def visit_Call(self, node):
            pass

        def leave_Call_func(self, node):
            pass

    classes = [*all_rules(), tfmigrate.cst.names.ImportTable, tfmigrate.rewrites.pipelines._Survey, Hooked, cst.CSTVisitor]
    for cls in classes:
        assert visitor_method_names(cls) == by_dir(cls), cls
    assert visitor_method_names(Hooked) == ("leave_Call_func", "visit_Call")


# A trainer importing its averaging helper `combine` from `utils.py` beside it.
TRAINER = PROJECT_TRAINER.replace("IMPORT", "utils import combine").replace("HELPER", "combine")


def test_a_result_read_from_other_project_files_is_not_cached(tmp_path, count_checks):
    """The trainer's finding depends on `utils.py` (whether `combine` averages): the cache,
    keyed by the trainer's bytes alone, keeps no result for it, and a change to `utils.py` shows."""
    write(tmp_path, "train.py", TRAINER)
    write(tmp_path, "utils.py", "import tensorflow as tf\n\n\ndef combine(tower_grads):\n"
          "    return [(tf.reduce_mean(tf.stack([g for g, _ in gv]), 0), gv[0][1]) for gv in zip(*tower_grads)]\n")
    _, cold, _ = check_json(tmp_path)
    assert entries(tmp_path) == [str(tmp_path / "utils.py")]
    write(tmp_path, "utils.py", "def combine(tower_grads):\n    return tower_grads[0]\n")
    count_checks.clear()
    _, warm, _ = check_json(tmp_path)
    assert sorted(Path(p).name for p in count_checks) == ["train.py", "utils.py"]
    (cold_fix,) = [f["fix"]["message"] for f in cold if f["code"] == "TFM101"]
    (warm_fix,) = [f["fix"]["message"] for f in warm if f["code"] == "TFM101"]
    # `combine` averaged: the update moved into the replicas; now unknown: it stays after the loop.
    assert "the update after the loop stays" not in cold_fix and "the update after the loop stays" in warm_fix
