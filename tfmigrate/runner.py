"""Check one file: read it once, parse it once, run every enabled rule in one pass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper

from tfmigrate.config import Config
from tfmigrate.names import ImportTable
from tfmigrate.registry import all_rules
from tfmigrate.rule import Edit, Finding, Rule, RuleContext
from tfmigrate.source import SourceError, SourceFile, decode_source, parse_source, read_source


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    parsed: bool = False  # False when the prefilter showed no rule could fire


@dataclass
class Analysis:
    """Everything one pass over a parsed module produced (kept in-process for `fix`)."""

    module: cst.Module
    reports: list[tuple[Rule, Finding, Edit | None]]


SUPPRESSION = re.compile(r"#\s*tfmigrate:\s*ignore(?:\[(?P<codes>[A-Za-z0-9_,\s-]+)\])?", re.I)


def suppressions(text: str) -> dict[int, set[str] | None]:
    """Line number -> the codes suppressed on it (None: every code)."""
    found: dict[int, set[str] | None] = {}
    if "tfmigrate:" not in text:
        return found
    for number, line in enumerate(text.splitlines(), start=1):
        if "#" not in line:
            continue
        for match in SUPPRESSION.finditer(line):
            codes = match.group("codes")
            if codes is None:
                found[number] = None
            elif found.get(number, set()) is not None:
                found.setdefault(number, set()).update(c.strip().upper() for c in codes.split(",") if c.strip())
    return found


def is_suppressed(finding: Finding, table: dict[int, set[str] | None]) -> bool:
    if finding.start.row not in table:
        return False
    codes = table[finding.start.row]
    return codes is None or any(finding.code.startswith(c) for c in codes)


def enabled_rules(config: Config, path: str | None = None) -> list[type[Rule]]:
    return [rule for rule in all_rules() if config.enabled(rule.code, path)]


def might_fire(text: str, rules: list[type[Rule]]) -> bool:
    """The cheap prefilter: a file mentioning none of the rules' trigger words is not parsed."""
    return any(word in text for rule in rules for word in rule.triggers)


def analyze_module(module: cst.Module, path: str, rules: list[type[Rule]], config: Config, text: str) -> Analysis:
    context = RuleContext(path=path, module=module, imports=ImportTable.from_module(module), target=config.target)
    # unsafe_skip_copy: the module is ours and never mutated; copying it costs as much as parsing.
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    wrapper.visit_batched([rule(context) for rule in rules])
    table = suppressions(text)
    kept = [(r, f, e) for (r, f, e) in context.reports if not is_suppressed(f, table)]
    kept.sort(key=lambda item: item[1].sort_key())
    return Analysis(module=module, reports=kept)


def analyze_source(source: SourceFile, config: Config) -> Analysis | None:
    """Parse and run the rules; None when the prefilter rules the file out."""
    rules = enabled_rules(config, source.path)
    if not rules or not might_fire(source.text, rules):
        return None
    module = parse_source(source)
    return analyze_module(module, source.path, rules, config, source.text)


def internal_error(exc: BaseException) -> str:
    """A one-line report of a bug, naming the rule it happened in when there is one."""
    code = None
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame that belongs to a rule
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, Rule):
            code = owner.code
        tb = tb.tb_next
    where = f" in {code}" if code else ""
    return f"internal error{where} ({type(exc).__name__}: {exc}); please report it"


def check_file(path: str, config: Config) -> FileResult:
    result = FileResult(path=path)
    try:
        source = read_source(path)
        analysis = analyze_source(source, config)
    except SourceError as exc:
        result.error = str(exc)
        return result
    except Exception as exc:  # a bug in a rule must not stop the run over the other files
        result.error = internal_error(exc)
        return result
    if analysis is not None:
        result.parsed = True
        result.findings = [finding for _, finding, _ in analysis.reports]
    return result


def check_text(text: str, config: Config, path: str = "<string>") -> list[Finding]:
    """Findings for a piece of source (used by tests and the rule examples)."""
    source = decode_source(path, text.encode("utf-8"))
    analysis = analyze_source(source, config)
    return [] if analysis is None else [finding for _, finding, _ in analysis.reports]
