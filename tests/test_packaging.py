"""A plain (non-editable) install must carry the rule catalog as tfmigrate.rules."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_wheel_contains_the_rule_catalog(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {out.stderr.strip()[-200:]}")
    (wheel,) = tmp_path.glob("tfmigrate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    rule_modules = sorted(p.name for p in (ROOT / "rules").glob("tfm*.py"))
    assert rule_modules, "no rule modules found in rules/"
    for module in rule_modules:
        assert f"tfmigrate/rules/{module}" in names
    assert "tfmigrate/rules/__init__.py" in names
    assert "tfmigrate/cli/main.py" in names and "tfmigrate/verify/__init__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tfmigrate = tfmigrate.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert not any(n.startswith(("tests/", "fixtures/", "rules/")) for n in names)
