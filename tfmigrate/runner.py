"""Check one file: read it once, parse it once, run every enabled rule in one pass."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from tfmigrate.config import Config
from tfmigrate.names import ImportTable
from tfmigrate.registry import all_rules
from tfmigrate.rule import Edit, Finding, Location, Rule, RuleContext
from tfmigrate.source import SourceError, SourceFile, decode_source, parse_source, read_bytes


@dataclass
class FileResult:
    """What checking one file gave: plain data, sent back from worker processes and cached."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    parsed: bool = False  # False when the prefilter showed no rule could fire
    notes: list[str] = field(default_factory=list)  # said on stderr; not errors (a skipped notebook cell)
    digest: str | None = None  # hash of the bytes checked (the cache key)


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


def rules_for(text: str, rules: list[type[Rule]]) -> list[type[Rule]]:
    """The rules whose trigger words the text mentions: only they walk the parsed module."""
    return [rule for rule in rules if any(word in text for word in rule.triggers)]


@functools.lru_cache(maxsize=None)
def _visitor_method_names(cls: type) -> tuple[str, ...]:
    """The visit_/leave_ methods a visitor class really defines (not LibCST's no-op stubs).

    LibCST's ``visit_batched`` finds them with ``inspect.getmembers`` on every visitor instance
    of every file; over the hundreds of stubs of a visitor class that took 12 ms per rule per
    file, more than parsing. A class's methods do not change: look once per class.
    """
    return tuple(
        name for name in dir(cls)
        if name.startswith(("visit_", "leave_")) and callable(getattr(cls, name))
        and not getattr(getattr(cls, name), "_is_no_op", False)
    )


class _Batched(cst.CSTVisitor):
    """One walk of the tree calling every rule's visit_/leave_ methods (what
    ``libcst.visit_batched`` does, with the method table looked up per class)."""

    def __init__(self, visitors: list[cst.BatchableCSTVisitor]) -> None:
        super().__init__()
        self.methods: dict[str, list] = {}
        for visitor in visitors:
            for name in _visitor_method_names(type(visitor)):
                self.methods.setdefault(name, []).append(getattr(visitor, name))

    def on_visit(self, node: cst.CSTNode) -> bool:
        for method in self.methods.get("visit_" + type(node).__name__, ()):
            method(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        for method in self.methods.get("leave_" + type(original_node).__name__, ()):
            method(original_node)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        for method in self.methods.get(f"visit_{type(node).__name__}_{attribute}", ()):
            method(node)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        for method in self.methods.get(f"leave_{type(original_node).__name__}_{attribute}", ()):
            method(original_node)


class _LazyPositions(Mapping):
    """Node positions, computed on the first lookup. Positions take a code-generation pass
    over the whole module (as long as the rules' own walk), and only a file with a finding
    needs them: most files checked have none."""

    def __init__(self, wrapper: MetadataWrapper) -> None:
        self.wrapper = wrapper
        self.table: Mapping | None = None

    def _positions(self) -> Mapping:
        if self.table is None:
            self.table = self.wrapper.resolve(PositionProvider)
        return self.table

    def __getitem__(self, node):
        return self._positions()[node]

    def __iter__(self):
        return iter(self._positions())

    def __len__(self) -> int:
        return len(self._positions())


def analyze_module(module: cst.Module, path: str, rules: list[type[Rule]], config: Config, text: str) -> Analysis:
    context = RuleContext(path=path, module=module, imports=ImportTable.from_module(module), target=config.target)
    # unsafe_skip_copy: the module is ours and never mutated; copying it costs as much as parsing.
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    visitors = [rule(context) for rule in rules]
    positions = _LazyPositions(wrapper)
    for visitor in visitors:
        # What MetadataDependent.resolve does, with the positions computed only when asked for.
        others = [p for p in visitor.get_inherited_dependencies() if p is not PositionProvider]
        visitor.metadata = {**wrapper.resolve_many(others), PositionProvider: positions}
    module.visit(_Batched(visitors))
    table = suppressions(text)
    kept = [(r, f, e) for (r, f, e) in context.reports if not is_suppressed(f, table)]
    kept.sort(key=lambda item: item[1].sort_key())
    return Analysis(module=module, reports=kept)


def analyze_source(source: SourceFile, config: Config) -> Analysis | None:
    """Parse and run the rules; None when the prefilter rules the file out."""
    rules = rules_for(source.text, enabled_rules(config, source.path))
    if not rules:
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


def is_notebook(path: str) -> bool:
    return path.endswith(".ipynb")


def in_cells(finding: Finding, notebook) -> Finding:
    """A finding on the concatenated cells, located by cell and line within the cell."""
    cell, row = notebook.location(finding.start.row)
    shift = finding.start.row - row
    return dataclasses.replace(
        finding, cell=cell, start=Location(row, finding.start.column),
        end=Location(finding.end.row - shift, finding.end.column),
    )


def check_file(path: str, config: Config) -> FileResult:
    from tfmigrate.cache import content_digest

    result = FileResult(path=path)
    notebook = None
    try:
        raw = read_bytes(path)
        result.digest = content_digest(raw)
        if is_notebook(path):
            from tfmigrate import notebook as nb

            notebook = nb.load(path, raw)
            result.notes = notebook.notes
            source = notebook.source_file()
        else:
            source = decode_source(path, raw)
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
        if notebook is not None:
            result.findings = [in_cells(f, notebook) for f in result.findings]
    return result


def check_text(text: str, config: Config, path: str = "<string>") -> list[Finding]:
    """Findings for a piece of source (used by tests and the rule examples)."""
    source = decode_source(path, text.encode("utf-8"))
    analysis = analyze_source(source, config)
    return [] if analysis is None else [finding for _, finding, _ in analysis.reports]
