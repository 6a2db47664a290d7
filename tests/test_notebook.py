"""Jupyter notebooks: code cells checked as one module, located by cell, fixed in place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import libcst as cst
import nbformat
import pytest
from libcst.codemod.visitors import ImportItem

import tfmigrate.engine.runner
from tfmigrate.engine import notebook as nb
from tfmigrate.rule import Edit, FixSafety, Rule

from .test_cli import run

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "notebooks" / "legacy_towers.ipynb"


@pytest.fixture
def copy(tmp_path) -> Path:
    target = tmp_path / "legacy_towers.ipynb"
    shutil.copyfile(FIXTURE, target)
    return target


def write_notebook(path: Path, cells: list[str], language: str = "python") -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {"kernelspec": {"name": "k", "display_name": "k", "language": language}}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(notebook, str(path))
    return path


def test_findings_are_located_by_cell_and_line(copy):
    result = run(["check", "--format", "json", "--no-cache", copy.name], copy.parent)
    assert result.exit_code == 1
    found = {(d["code"], d["cell"], d["location"]["row"], d["location"]["column"]) for d in json.loads(result.stdout)}
    # Cell 4's loop uses the `tf` imported in cell 2; cell 6 starts with a %%time magic.
    assert found == {("TFM101", 4, 4, 1), ("TFM201", 6, 4, 18)}


def test_text_output_names_the_cell_and_shows_the_cell_line(copy):
    result = run(["check", "--no-cache", copy.name], copy.parent)
    assert "legacy_towers.ipynb:cell 4:4:1: TFM101" in result.stdout
    assert "4 | for i in range(num_gpus):" in result.stdout
    assert "legacy_towers.ipynb:cell 6:4:18: TFM201" in result.stdout


def test_magics_are_masked_line_for_line():
    notebook = nb.load("x.ipynb", FIXTURE.read_bytes())
    magic_cell = next(c for c in notebook.cells if c.number == 3)
    assert sorted(magic_cell.magics.values()) == ["!nvidia-smi -L", "%matplotlib inline", "tf.device?"]
    assert len(magic_cell.masked) == len(magic_cell.text.split("\n"))
    bash_cell = next(c for c in notebook.cells if c.number == 7)
    assert bash_cell.masked is None  # %%bash: not Python, not checked
    assert nb.reproducible(notebook)  # the fixture re-serialises to its exact bytes


def test_cell_that_cannot_be_masked_is_skipped_with_a_note(tmp_path):
    write_notebook(tmp_path / "n.ipynb", [
        "import tensorflow as tf",
        "for f in files:\n    %time load(f)",  # the masked body is only a comment: not Python
        "for i in range(2):\n    with tf.device('/gpu:%d' % i):\n        y = model(x)",
    ])
    result = run(["check", "--format", "json", "--no-cache", "n.ipynb"], tmp_path)
    assert result.exit_code == 1
    assert "n.ipynb: note: cell 2: IPython syntax tfmigrate cannot mask" in result.stderr
    assert [(d["code"], d["cell"], d["location"]["row"]) for d in json.loads(result.stdout)] == [("TFM101", 3, 1)]


def test_syntax_error_names_the_cell(tmp_path):
    write_notebook(tmp_path / "n.ipynb", ["import tensorflow as tf", "with tf.device('/gpu:0')\n    x = 1"])
    result = run(["check", "--no-cache", "n.ipynb"], tmp_path)
    assert result.exit_code == 2
    assert "n.ipynb: error: syntax error in cell 2 at line 1" in result.stderr


def test_non_python_notebook_and_broken_json(tmp_path):
    write_notebook(tmp_path / "r.ipynb", ["for (i in 1:2) device('/gpu:0')"], language="R")
    assert run(["check", "--no-cache", "r.ipynb"], tmp_path).exit_code == 0
    (tmp_path / "bad.ipynb").write_text("{not json")
    result = run(["check", "--no-cache", "bad.ipynb"], tmp_path)
    assert result.exit_code == 2 and "not a valid notebook" in result.stderr


def m_compat(node: cst.Attribute) -> bool:
    return "compat" in cst.Module([]).code_for_node(node)


class QualifyOptimizer(Rule):
    """Toy safe fix: `tf.train.X` -> `tf.compat.v1.train.X`, plus an import added at the top."""

    code, name, summary, triggers = "TFM901", "toy-qualify", "toy", ("train",)
    fix_safety = FixSafety.SAFE

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if self.qualified(node) == "tensorflow.train.GradientDescentOptimizer" and not m_compat(node):
            new = cst.parse_expression("tf.compat.v1.train.GradientDescentOptimizer")
            self.report(node, "qualify", edit=Edit({node: new}, "qualify", add_imports=[ImportItem("os")]))


@pytest.fixture
def toy_rule(monkeypatch):
    monkeypatch.setattr(tfmigrate.engine.runner, "all_rules", lambda: (QualifyOptimizer,))
    monkeypatch.setattr("tfmigrate.cli.main._known_prefix", lambda code: True)


def test_fix_preview_is_a_diff_per_cell(copy, toy_rule):
    before = copy.read_bytes()
    result = run(["fix", copy.name], copy.parent)
    assert result.exit_code == 1
    assert "--- legacy_towers.ipynb:cell 4" in result.stdout
    assert "+opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)" in result.stdout
    assert copy.read_bytes() == before


def test_fix_write_changes_only_the_sources_of_changed_code_cells(copy, toy_rule):
    before = json.loads(copy.read_text(encoding="utf-8"))
    result = run(["fix", "--write", "--exit-non-zero-on-fix", copy.name], copy.parent)
    assert result.exit_code == 1, result.stderr  # it changed the file
    text = copy.read_text(encoding="utf-8")
    after = json.loads(text)
    nbformat.validate(nbformat.reads(text, as_version=4))

    changed = [i for i, (a, b) in enumerate(zip(before["cells"], after["cells"])) if a != b]
    assert changed == [1, 3]  # cell 2 got the import, cell 4 the fix; nothing else moved
    for a, b in zip(before["cells"], after["cells"]):
        assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
    assert after["metadata"] == before["metadata"]
    assert "import os\n" in after["cells"][1]["source"]  # imports a fix adds go to the first code cell
    assert "opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)\n" in after["cells"][3]["source"]
    assert after["cells"][3]["source"][-1] == "        tower_grads.append(opt.compute_gradients(loss))"  # no newline: as before
    assert after["cells"][2]["source"] == before["cells"][2]["source"]  # the magics, verbatim
    # The layout is Jupyter's (indent 1, sorted keys as they were), so a diff shows only the edit.
    assert text == json.dumps(after, indent=1, ensure_ascii=False) + "\n"

    again = run(["fix", "--write", "--exit-non-zero-on-fix", copy.name], copy.parent)
    assert again.exit_code == 0 and copy.read_text(encoding="utf-8") == text


def test_a_fix_that_touches_a_magic_is_refused(tmp_path, monkeypatch):
    class DropEverything(Rule):
        code, name, summary, triggers = "TFM902", "toy-drop", "toy", ("device",)
        fix_safety = FixSafety.SAFE

        def visit_Module(self, node: cst.Module) -> None:
            self.report(node, "drop", edit=Edit({node: node.with_changes(body=[], header=[])}, "drop"))

    monkeypatch.setattr(tfmigrate.engine.runner, "all_rules", lambda: (DropEverything,))
    monkeypatch.setattr("tfmigrate.cli.main._known_prefix", lambda code: True)
    path = write_notebook(tmp_path / "n.ipynb", ["%matplotlib inline\nimport tensorflow as tf\ntf.device('/gpu:0')"])
    before = path.read_bytes()
    result = run(["fix", "--write", "n.ipynb"], tmp_path)
    assert result.exit_code == 2 and "notebook left untouched" in result.stderr
    assert path.read_bytes() == before
