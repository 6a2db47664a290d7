"""Finds the rules: every module in ``tfmigrate.rules`` defines one ``Rule`` subclass.

The engine never names a rule; adding a rule is adding a module (and its fixtures).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil

from tfmigrate.rule import Rule


@functools.lru_cache(maxsize=None)
def all_rules() -> tuple[type[Rule], ...]:
    import tfmigrate.rules as package

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
