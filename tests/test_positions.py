"""The positions computed one top-level statement at a time are LibCST's own, node for node."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from tests.conftest import FIXTURES, ROOT
from tfmigrate.engine.positions import LazyPositions
from tfmigrate.cst.walker import skipped_types, walk

TRICKY = {
    "header_comments": "#!/usr/bin/env python\n# header\n\n\nimport tensorflow as tf\n",
    "semicolons": "import os; import sys\nx = 1; y = 2; z = 3\nfor i in range(2): print(i); print(i)\n",
    "decorators_with_comments": textwrap.dedent("""\
        import functools

        # before the decorators
        @functools.lru_cache()

        # between two decorators
        @functools.wraps(
            print,
        )
        def f(
            a,
        ):
            return a  # trailing
        # footer of the block
        x = f(1)
        """),
    "decorator_expression_on_next_line": "@(\n    staticmethod\n)\ndef g():\n    pass\n",
    "continuations": "x = 1 + \\\n    2\nif x:\n    y = [\n        1,\n    ]\n",
    "crlf": "import tensorflow as tf\r\n\r\nfor i in range(2):\r\n    with tf.device('/gpu:%d' % i):\r\n        pass\r\n",
    "strings_spanning_lines": 's = """a\nb\nc"""\nt = (\'x\'\n     \'y\')\nclass C:\n    """doc\n    string"""\n',
    "form_feed_in_string": "a = '\\x0c'\nb = 'x\x0cy'\nc = 2\n",
    "no_final_newline": "import tensorflow as tf\nx = tf.constant(1)",
    "tabs": "if True:\n\tx = 1\n\tif x:\n\t\ty = 2\n",
}


# Python puts a decorator on the line of its expression, not of its `@`: the shift cannot be
# known, the text check catches it, and the whole module's positions are used (still exact).
FALLS_BACK = {"decorator_expression_on_next_line"}


def _corpus() -> list:
    cases = [pytest.param(text, name in FALLS_BACK, id=name) for name, text in TRICKY.items()]
    for path in sorted(FIXTURES.rglob("*.py")) + sorted((ROOT / "tfmigrate").glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        cases.append(pytest.param(text, False, id=str(path.relative_to(ROOT))))
    return cases


def _statement_of(module: cst.Module) -> dict[int, int]:
    top = {id(statement): index for index, statement in enumerate(module.body)}
    found: dict[int, int] = {}
    current = -1

    def on_visit(node) -> None:
        nonlocal current
        current = top.get(id(node), current)
        found[id(node)] = current

    walk(module, on_visit, lambda node: None, skipped_types(()))
    return found


@pytest.mark.parametrize(("text", "falls_back"), _corpus())
def test_positions_per_statement_equal_libcst_positions(text, falls_back):
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        pytest.skip("a deliberately broken fixture")
    expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    statement_of = _statement_of(module)
    positions = LazyPositions(module, text, statement_of)
    nodes = [node for node in expected if statement_of.get(id(node), -1) >= 0]
    assert nodes or not module.body
    for node in nodes:
        assert positions[node] == expected[node], (type(node).__name__, module.code_for_node(node)[:60])
    # Exactness came from the per-statement pass, not from the whole-module fallback.
    assert (positions.whole is not None) == falls_back


def test_a_statement_whose_text_does_not_match_falls_back_to_the_whole_module():
    text = "x = 1\ny = 2\n"
    module = cst.parse_module(text)
    positions = LazyPositions(module, "x = 1\nz = 2\n", _statement_of(module))  # stale text
    target = module.body[1]
    assert positions[target].start.line == 2
    assert positions.whole is not None


TWINS_TEXT = textwrap.dedent("""\
    import tensorflow as tf
    NAME = 'café'; other = tf.constant('ü' * 3)


    def towers(n):  # the loop and calls below get ast's ranges
        for i in range(n):
            with tf.device('/gpu:%d' % i), tf.name_scope('t'):
                x = tf.get_variable('w', [1]).read_value()(  # chained calls start together
                    1)
                y = (tf.identity(x))  # parenthesized: LibCST's range includes the parentheses
                print('é', tf.reduce_sum(y))
        async def g():
            async for a in b():
                async with c() as d:
                    pass
        return [f(k) for k in g(lambda: h(1))]


    def log(x):  # calls inside f-strings take the generated code's ranges
        print(f"{tf.shape(x)} {f'{len(x)}'}", str(x))
    """)


def test_calls_and_loops_take_pythons_ranges_without_generating_code():
    module = cst.parse_module(TWINS_TEXT)
    expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    statement_of = _statement_of(module)
    positions = LazyPositions(module, TWINS_TEXT, statement_of)
    twins = [n for n in expected if isinstance(n, (cst.Call, cst.For, cst.With)) and statement_of[id(n)] >= 0]
    in_fstrings = set()
    for fstring in [n for n in expected if isinstance(n, cst.FormattedString)]:
        walk(fstring, lambda n: in_fstrings.add(id(n)), lambda n: None, skipped_types(()))
    plain = [n for n in twins if id(n) not in in_fstrings and not (isinstance(n, cst.Call) and n.lpar)]
    assert len(plain) >= 20 and len(twins) - len(plain) == 3
    for node in plain:
        assert positions[node] == expected[node], module.code_for_node(node)[:40]
    # ... and no statement's code was generated for them.
    assert positions.parts == {} and positions.whole is None
    for node in twins:  # the rest (parentheses, f-strings) through the generated code: still exact
        assert positions[node] == expected[node], module.code_for_node(node)[:40]


def test_a_twin_whose_text_does_not_start_as_the_node_is_not_used():
    text = "x = f(1)\n"
    module = cst.parse_module(text)
    positions = LazyPositions(module, "x = g(1)\n", _statement_of(module))  # stale text
    call = module.body[0].body[0].value
    assert positions._twin_range(call, 0) is None


def _stdlib_sample() -> list:
    """A fixed sample of the standard library's own modules: syntax nobody wrote for tfmigrate."""
    import sysconfig
    from pathlib import Path

    folder = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse", "ast", "dataclasses", "difflib", "enum", "functools", "inspect", "json/decoder",
             "pathlib", "pprint", "shutil", "string", "tarfile", "textwrap", "tokenize", "typing", "zipfile",
             "asyncio/base_events", "email/message", "unittest/case"]
    return [pytest.param(folder / f"{name}.py", id=name) for name in names if (folder / f"{name}.py").exists()]


@pytest.mark.parametrize("path", _stdlib_sample())
def test_python_ranges_of_calls_and_loops_equal_libcsts_on_the_standard_library(path):
    text = path.read_text(encoding="utf-8")
    module = cst.parse_module(text)
    expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    statement_of = _statement_of(module)
    positions = LazyPositions(module, text, statement_of)
    paired = 0
    for node, expected_range in expected.items():
        if isinstance(node, (cst.Call, cst.For, cst.With)) and statement_of.get(id(node), -1) >= 0:
            twin = positions._twin_range(node, statement_of[id(node)])
            if twin is not None:
                assert twin == expected_range, module.code_for_node(node)[:60]
                paired += 1
    assert paired > 20
