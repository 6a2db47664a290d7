"""The fixture corpus: each `# expect: CODE` marker must be reported on its line, and nothing else.

Layout (see CONTRIBUTING.md): fixtures/<CODE>/*.py are detection cases; `*.after.py` files
are the golden output of a fix and are checked by the fix tests instead; fixtures/negative/
holds modern or harmless code that must yield no TFM1xx/2xx/3xx finding.
"""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES, expected_markers, run_check

RULE_FOLDERS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name.startswith("TFM"))
DETECTION_CASES = sorted(
    path for folder in RULE_FOLDERS for path in folder.glob("*.py") if not path.name.endswith(".after.py")
)
NEGATIVE_CASES = sorted((FIXTURES / "negative").glob("*.py"))


@pytest.mark.parametrize("path", DETECTION_CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_detection_fixture(path):
    text = path.read_text(encoding="utf-8")
    expected = expected_markers(text)
    assert any(code == path.parent.name for _, code in expected), f"{path} has no marker for its own rule"
    found = {(f.start.row, f.code) for f in run_check(text)}
    assert found == expected, f"missing: {sorted(expected - found)}  unexpected: {sorted(found - expected)}"


@pytest.mark.parametrize("path", NEGATIVE_CASES, ids=lambda p: p.name)
def test_negative_fixture_has_no_migration_finding(path):
    findings = run_check(path.read_text(encoding="utf-8"))
    blocking = [f for f in findings if f.code[:4] in ("TFM1", "TFM2", "TFM3")]
    assert blocking == [], [(f.start.row, f.code, f.message) for f in blocking]


def test_every_rule_has_a_fixture_folder():
    from tfmigrate.engine.registry import all_rules

    missing = [r.code for r in all_rules() if not (FIXTURES / r.code).is_dir()]
    assert missing == []
