"""Finds the rules: every module in ``tfmigrate.rules`` defines one ``Rule`` subclass.

The engine never names a rule; adding a rule is adding a module (and its fixtures).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil
import sys
from pathlib import Path

from tfmigrate.rule import Rule


def _rules_package():
    """``tfmigrate.rules``: installed inside the package, or the checkout's top-level rules/.

    When the tests run from a source checkout, ``tfmigrate`` is imported from the checkout's
    folder, which has no ``rules`` subpackage: load the sibling ``rules/`` under that name.
    """
    try:
        return importlib.import_module("tfmigrate.rules")
    except ModuleNotFoundError as exc:
        if exc.name != "tfmigrate.rules":
            raise
    checkout = Path(__file__).resolve().parent.parent / "rules"
    spec = importlib.util.spec_from_file_location(
        "tfmigrate.rules", checkout / "__init__.py", submodule_search_locations=[str(checkout)]
    )
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("tfmigrate.rules: the rule catalog is missing from this installation")
    package = importlib.util.module_from_spec(spec)
    sys.modules["tfmigrate.rules"] = package
    spec.loader.exec_module(package)
    return package


@functools.lru_cache(maxsize=None)
def all_rules() -> tuple[type[Rule], ...]:
    package = _rules_package()

    found: list[type[Rule]] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        classes = [
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj)
            and issubclass(obj, Rule)
            and obj is not Rule
            and obj.__module__ == module.__name__
        ]
        if len(classes) != 1:
            raise RuntimeError(f"{module.__name__} must define exactly one rule, found {len(classes)}")
        found.append(classes[0])
    codes = [rule.code for rule in found]
    duplicated = {c for c in codes if codes.count(c) > 1}
    if duplicated:
        raise RuntimeError(f"duplicate rule codes: {sorted(duplicated)}")
    return tuple(sorted(found, key=lambda r: r.code))


def rule_by_code(code: str) -> type[Rule] | None:
    code = code.upper()
    for rule in all_rules():
        if rule.code == code or rule.name == code.lower():
            return rule
    return None
