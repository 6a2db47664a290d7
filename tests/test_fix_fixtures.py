"""Fix goldens: fixtures/<CODE>/<case>.before.py must become <case>.after.py, exactly.

Each pair is fixed with only its own rule selected (unsafe fixes allowed), so a golden shows
one rule's rewrite. For every pair: the output parses, equals the reviewed golden, a second fix
changes nothing, and the fixed finding is gone from `check`.
"""

from __future__ import annotations

import libcst as cst
import pytest

from tests.conftest import FIXTURES, ROOT
from tfmigrate.engine.config import Config
from tfmigrate.engine.fixer import fix_text
from tfmigrate.engine.runner import check_text

PAIRS = sorted(FIXTURES.glob("TFM*/*.before.py"))


def _config(code: str, before=None) -> Config:
    # A case named `*_tf2` shows the tf2 target's rewrite; `*_dataset`, the compat target's with
    # `tower-input = "dataset"` (fed batches become a distributed tf.data pipeline).
    name = before.name if before is not None else ""
    return Config(
        root=ROOT, select=[code], target="tf2" if name.endswith("_tf2.before.py") else "compat",
        tower_input="dataset" if name.endswith("_dataset.before.py") else "keep",
    )


@pytest.mark.parametrize("before", PAIRS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fix_golden(before):
    code = before.parent.name
    after = before.with_name(before.name.replace(".before.py", ".after.py"))
    assert after.exists(), f"{before.name} has no golden {after.name}"
    config = _config(code, before)
    fixed = fix_text(before.read_text(encoding="utf-8"), config, unsafe=True)
    cst.parse_module(fixed)
    compile(fixed, str(after), "exec")
    assert fixed == after.read_text(encoding="utf-8")
    assert fix_text(fixed, config, unsafe=True) == fixed, "a second fix changed the file"
    assert not [f for f in check_text(fixed, config) if f.fixable], f"{code} is still fixable after the fix"
