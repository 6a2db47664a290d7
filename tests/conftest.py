from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tfmigrate.config import Config
from tfmigrate.runner import check_text

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
EXPECT = re.compile(r"#\s*expect:\s*(TFM\d+(?:\s*,\s*TFM\d+)*)")


def run_check(code: str, **config) -> list:
    """Findings for a snippet (dedented; line 1 is its first non-blank line), every rule enabled
    unless ``config`` says otherwise."""
    return check_text(textwrap.dedent(code).strip("\n") + "\n", Config(root=ROOT, **config))


def expected_markers(text: str) -> set[tuple[int, str]]:
    """(line, code) pairs declared by `# expect: TFM101, TFM103` comments in a fixture."""
    found = set()
    for number, line in enumerate(text.splitlines(), start=1):
        match = EXPECT.search(line)
        if match:
            found |= {(number, code.strip()) for code in match.group(1).split(",")}
    return found


@pytest.fixture
def check():
    return run_check
