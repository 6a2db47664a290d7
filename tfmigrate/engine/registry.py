"""Finds the rules: every module in ``tfmigrate.rules`` defines one ``Rule`` subclass.

The engine never names a rule; adding a rule is adding a module (and its fixtures).

Importing the rules imports LibCST (about a second of start-up with everything the rules
use). What `check` needs before it parses anything -- the codes (to validate ``--select``),
names and trigger words (the prefilter) -- is the rule *catalog*: plain data computed from the
rules once and stored in the cache folder under the engine fingerprint (see
:mod:`tfmigrate.engine.cache`). A run that finds the catalog there and whose files are all cache
hits or prefiltered never imports LibCST or a rule.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    checkout = Path(__file__).resolve().parents[2] / "rules"
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
    found = [
        _rule_in(package, info.name) for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")
    ]
    codes = [rule.code for rule in found]
    duplicated = {c for c in codes if codes.count(c) > 1}
    if duplicated:
        raise RuntimeError(f"duplicate rule codes: {sorted(duplicated)}")
    return tuple(sorted(found, key=lambda r: r.code))


def _rule_in(package, module_name: str) -> type[Rule]:
    """The one rule class a module of the rules package defines."""
    from tfmigrate.rule import Rule

    module = importlib.import_module(f"{package.__name__}.{module_name}")
    classes = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, Rule) and obj is not Rule and obj.__module__ == module.__name__
    ]
    if len(classes) != 1:
        raise RuntimeError(f"{module.__name__} must define exactly one rule, found {len(classes)}")
    return classes[0]


def rules_with_codes(codes: set[str]) -> list[type[Rule]]:
    """The rules with these codes, in code order. With a catalog read from the cache only their
    modules are imported (a pre-commit run on one file needs a few of the rules)."""
    stored = {info.code: info.module for info in _catalog or ()}
    if all_rules.cache_info().currsize or not codes <= stored.keys() or not all(stored[c] for c in codes):
        return [rule for rule in all_rules() if rule.code in codes]
    package = _rules_package()
    return sorted((_rule_in(package, stored[code]) for code in codes), key=lambda rule: rule.code)


def rule_by_code(code: str) -> type[Rule] | None:
    code = code.upper()
    for rule in all_rules():
        if rule.code == code or rule.name == code.lower():
            return rule
    return None


# --- the catalog ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleInfo:
    """What the engine knows about a rule without importing it."""

    code: str
    name: str
    summary: str
    triggers: tuple[str, ...]
    fix_safety: str  # FixSafety's value
    informational: bool
    requires: tuple[str, ...] = ()
    module: str = ""  # the rule's module in the rules package

    def to_json(self) -> dict:
        return {**asdict(self), "triggers": list(self.triggers), "requires": list(self.requires)}

    @classmethod
    def from_json(cls, data: dict) -> RuleInfo:
        triggers, requires = data["triggers"], data["requires"]
        for words in (triggers, requires):
            if not isinstance(words, list) or not all(isinstance(t, str) for t in words):
                raise TypeError("triggers")
        info = cls(
            code=str(data["code"]), name=str(data["name"]), summary=str(data["summary"]),
            triggers=tuple(triggers), fix_safety=str(data["fix_safety"]), informational=bool(data["informational"]),
            requires=tuple(requires), module=str(data["module"]),
        )
        return info


def could_fire(rule, text: str, matched: dict[str, bool] | None = None) -> bool:
    """The prefilter, for a rule or its RuleInfo: the text mentions one of its trigger words
    and matches each of its ``requires`` patterns. A file no enabled rule could fire on is
    not parsed. ``matched`` remembers the patterns' answers on this text across rules (several
    rules require the same one)."""
    if not any(word in text for word in rule.triggers):
        return False
    matched = {} if matched is None else matched
    for pattern in rule.requires:
        answer = matched.get(pattern)
        if answer is None:
            answer = matched[pattern] = re.search(pattern, text) is not None
        if not answer:
            return False
    return True


_catalog: tuple[RuleInfo, ...] | None = None  # from the cache, or computed by catalog()


def computed_catalog() -> tuple[RuleInfo, ...]:
    """The catalog, from the rules themselves (imports them)."""
    return tuple(
        RuleInfo(
            rule.code, rule.name, rule.summary, tuple(rule.triggers), rule.fix_safety.value, rule.informational,
            tuple(rule.requires), rule.__module__.rsplit(".", 1)[-1],
        )
        for rule in all_rules()
    )


def use_catalog(entries: tuple[RuleInfo, ...] | None) -> None:
    """Install a catalog read back from the cache (it must describe the rules of this very
    engine: the cache keys it by the engine fingerprint)."""
    global _catalog
    _catalog = entries


def stored_catalog() -> tuple[RuleInfo, ...] | None:
    """The catalog installed by ``use_catalog``, if any."""
    return _catalog


def catalog() -> tuple[RuleInfo, ...]:
    """Every rule's code, name, triggers...: the stored catalog when one was installed, else
    computed from the rules."""
    global _catalog
    if _catalog is None:
        _catalog = computed_catalog()
    return _catalog


def info_by_code(code: str) -> RuleInfo | None:
    for info in catalog():
        if info.code == code:
            return info
    return None
