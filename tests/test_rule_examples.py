"""Every rule's own valid/invalid examples and documentation, as Fixit turns them into tests."""

from __future__ import annotations

import textwrap

import pytest

from tfmigrate.engine.registry import all_rules
from tests.conftest import run_check

RULES = all_rules()


def _cases(kind: str) -> list:
    return [
        pytest.param(rule, example, id=f"{rule.code}-{kind}-{index}")
        for rule in RULES
        for index, example in enumerate(getattr(rule, kind))
    ]


@pytest.mark.parametrize("rule, code", _cases("valid"))
def test_valid_example_is_not_reported(rule, code):
    findings = run_check(code, select=[rule.code])
    assert findings == [], [f.message for f in findings]


@pytest.mark.parametrize("rule, example", _cases("invalid"))
def test_invalid_example_is_reported(rule, example):
    findings = run_check(example.code, select=[rule.code])
    assert findings, f"{rule.code} did not report:\n{textwrap.dedent(example.code)}"
    assert {f.code for f in findings} == {rule.code}
    if example.line is not None:
        assert example.line in {f.start.row for f in findings}


def _fixed_cases() -> list:
    return [
        pytest.param(rule, example, id=f"{rule.code}-fixed-{index}")
        for rule in RULES
        for index, example in enumerate(rule.invalid)
        if example.fixed is not None
    ]


@pytest.mark.parametrize("rule, example", _fixed_cases())
def test_invalid_example_is_fixed_as_the_rule_says(rule, example):
    """Fixit's `Invalid(expected_replacement=...)`: the rule's own fix of its example, and nothing else."""
    from tfmigrate.engine.config import Config
    from tfmigrate.engine.fixer import fix_text
    from tests.conftest import ROOT

    source = textwrap.dedent(example.code).strip("\n") + "\n"
    config = Config(root=ROOT, select=[rule.code])
    fixed = fix_text(source, config, unsafe=example.unsafe)
    assert fixed == textwrap.dedent(example.fixed).strip("\n") + "\n"
    if not example.unsafe:
        return
    assert fix_text(source, config, unsafe=False) == source  # an unsafe fix waits for --unsafe-fixes


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_rule_is_documented(rule):
    assert rule.code.startswith("TFM") and len(rule.code) == 6
    assert rule.name == rule.name.lower() and " " not in rule.name
    for section in ("summary", "what_it_finds", "why", "example", "use_instead", "fix_notes"):
        assert getattr(rule, section).strip(), f"{rule.code} has no {section}"
    assert rule.triggers, f"{rule.code} has no trigger words for the prefilter"
    assert rule.valid and rule.invalid, f"{rule.code} needs valid and invalid examples"
    page = rule.documentation()
    for heading in ("## What it finds", "## Why it matters", "## Example", "## Use instead", "## Fix safety"):
        assert heading in page


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_doc_example_is_reported_and_use_instead_is_not(rule):
    # The docs' example is usually a fragment; give it the import it assumes.
    prelude = "import tensorflow as tf\nimport keras\n"
    example = prelude + textwrap.dedent(rule.example)
    assert any(f.code == rule.code for f in run_check(example, select=[rule.code])), rule.code
    fixed = prelude + textwrap.dedent(rule.use_instead)
    assert not any(f.code == rule.code for f in run_check(fixed, select=[rule.code])), rule.code


def test_codes_are_unique_and_sorted():
    codes = [r.code for r in RULES]
    assert codes == sorted(set(codes))
