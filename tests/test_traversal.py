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
