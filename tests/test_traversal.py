"""The per-file index behind ``cst.traversal.find`` answers exactly as a walk does."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from tfmigrate.cst import traversal
from tfmigrate.cst.traversal import find, find_own, index_module, own_nodes, walk
from tfmigrate.engine.config import Config
from tfmigrate.engine.runner import check_text

PROGRAMS = sorted((Path(__file__).parent.parent / "fixtures" / "programs").glob("*.py"))[:6]
KINDS = [(cst.Call,), (cst.Name,), (cst.Assign, cst.AugAssign), (cst.BaseSmallStatement,), (cst.BaseExpression,),
         (cst.FunctionDef, cst.For, cst.With)]


def _walked(node, types):
    return [n for n in walk(node) if isinstance(n, types)]


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_find_from_the_index_is_the_walk(path):
    module = cst.parse_module(path.read_text())
    statement_of = {}
    for index, statement in enumerate(module.body):
        for node in walk(statement):
            statement_of[id(node)] = index
    index_module(module, statement_of)
    try:
        nodes = list(walk(module))
        for types in KINDS:
            for node in [module, *nodes[::7]]:
                assert find(node, *types) == _walked(node, types)
                own = [n for n in own_nodes(node) if isinstance(n, types)]
                assert find_own(node, *types) == own
        assert len(traversal._INDEX[0].parts) == len(module.body)  # answered from the index
    finally:
        index_module(None)


def test_find_own_leaves_out_what_nested_scopes_hold():
    module = cst.parse_module(
        "def f(x):\n    a = 1\n    def g():\n        b = 2\n        class C:\n            c = 3\n"
        "    h = lambda: [d for d in x]\n    e = 4\n"
    )
    statement_of = {id(node): 0 for node in walk(module.body[0])}
    index_module(module, statement_of)
    try:
        names = [t.target.value for t in find_own(module.body[0], cst.AssignTarget)]
        scopes = [type(n).__name__ for n in find_own(module.body[0], cst.FunctionDef, cst.Lambda, cst.ListComp)]
    finally:
        index_module(None)
    assert names == ["a", "h", "e"] and scopes == ["FunctionDef", "FunctionDef", "Lambda"]


def test_a_node_of_another_tree_is_walked():
    module = cst.parse_module("def f():\n    return g(h(1))\n")
    index_module(module, {})
    try:
        other = cst.parse_expression("a(b(c()))")
        assert [cst.ensure_type(c.func, cst.Name).value for c in find(other, cst.Call)] == ["a", "b", "c"]
        assert [c.func.value for c in find(module, cst.Call)] == ["g", "h"]
    finally:
        index_module(None)


def test_the_runner_indexes_each_file_it_checks():
    text = "import tensorflow as tf\nfor i in range(2):\n    with tf.device('/gpu:%d' % i):\n        y = f(x)\n"
    check_text(text, Config(root=Path(".")))
    index = traversal._INDEX[0]
    assert index is not None and index.parts  # the rules' finds were answered from it


def test_statements_placed_after_imports_keep_the_changes_inside_the_import_and_the_statement_after():
    """A class written after the last import, where another change of the same fix renames that
    import's module (`keras.utils.np_utils`) and rewrites a method of the class just below it:
    both changes stay (the import kept its Keras 2 path, and a held-out ResNet script failed)."""
    from tfmigrate.engine.fixer import _ApplyChanges

    module = cst.parse_module("import os\nfrom keras.utils.np_utils import to_categorical\nclass A:\n"
                              "    def f(self):\n        return 1\n")
    imported = module.body[1].body[0]
    method = module.body[2].body.body[0]
    changes = {imported: imported.with_changes(module=cst.parse_expression("keras.utils")),
               method: method.with_changes(name=cst.Name("g"))}
    changes.update(traversal.placed_after_imports(module, changes, [cst.parse_statement("X = 1\n")]))
    new = module.visit(_ApplyChanges({id(node): new for node, new in changes.items()})).code
    assert new == ("import os\nfrom keras.utils import to_categorical\n\n\nX = 1\n\n\nclass A:\n"
                   "    def g(self):\n        return 1\n")
