"""Check one file: read it once, parse it once, run every enabled rule in one pass.

LibCST and the rules are imported only when a file has to be parsed: the prefilter works
from the rule catalog (:func:`tfmigrate.engine.registry.catalog`), so a run whose files are cache hits
or mention no rule's trigger words starts in a fraction of the time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfmigrate.engine.config import Config
from tfmigrate.findings import FileResult, Finding, Location
from tfmigrate.engine import registry
from tfmigrate.engine.registry import all_rules
from tfmigrate.engine.source import SourceError, SourceFile, decode_source, read_bytes, split_lines
from tfmigrate.engine.positions import TWIN_KINDS, LazyPositions
from tfmigrate.cst.walker import is_attribute_hook, skipped_types, visitor_method_names, walk

if TYPE_CHECKING:
    import ast

    import libcst as cst
    from libcst.metadata import MetadataWrapper

    from tfmigrate.rule import Edit, Rule, RuleContext

__all__ = [
    "Analysis", "FileResult", "TOO_DEEP", "analyze_module", "analyze_source", "check_bytes", "check_file", "check_text",
    "collector_paused", "enabled_rules", "in_cells", "internal_error", "is_notebook", "is_suppressed", "suppressions",
]


@dataclass
class Analysis:
    """Everything one pass over a parsed module produced (kept in-process for `fix`)."""

    module: cst.Module
    reports: list[tuple[Rule, Finding, Edit | None]]
    read_paths: frozenset[str] = frozenset()  # other files of the project the rules read


# A file whose syntax tree is deeper than Python's recursion limit lets the rules walk.
TOO_DEEP = "too deeply nested to check (more levels than Python's recursion limit allows); not checked"

SUPPRESSION = re.compile(r"#\s*tfmigrate:\s*ignore(?:\[(?P<codes>[A-Za-z0-9_,\s-]+)\])?", re.I)


def suppressions(text: str) -> dict[int, set[str] | None]:
    """Line number -> the codes suppressed on it (None: every code)."""
    found: dict[int, set[str] | None] = {}
    if "tfmigrate:" not in text:
        return found
    for number, line in enumerate(split_lines(text), start=1):
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


def codes_for(text: str, config: Config, path: str | None = None) -> set[str]:
    """The prefilter: the codes of the enabled rules whose trigger words the text mentions.
    From the rule catalog read from the cache when there is one (no rule imported), else from
    the rules themselves (``all_rules`` here, which tests replace with rules of their own)."""
    rules = registry.stored_catalog() if all_rules is registry.all_rules else None
    if rules is None:
        rules = all_rules()
    matched: dict[str, bool] = {}
    return {
        rule.code for rule in rules
        if config.enabled(rule.code, path) and registry.could_fire(rule, text, matched)
    }


def _walk_rules(
    module: cst.Module, visitors: list, statement_of: dict[int, int], in_order: dict, walked: set[int],
    context: RuleContext,
) -> None:
    """Call the visitors' visit_X/leave_X methods over the module, as ``module.visit`` of a
    batched visitor would, with the read-only walk of :mod:`tfmigrate.cst.walker` (the rules only
    read the tree). A rule's visit_X returning False does not stop the others. Fills
    ``statement_of`` (id(node) -> index of the top-level statement it lies in), and for
    :class:`LazyPositions` ``in_order`` (the calls, for and with statements of each top-level
    one) and ``walked`` (the top-level statements left so far), and the context's ``parents``
    (id(node) -> its parent) and ``walk_complete`` (see RuleContext). With per-field hooks
    LibCST's walk fills none of them: positions then come from LibCST's own pass, parents from
    the analyses' own walks."""
    names = [(visitor, name) for visitor in visitors for name in visitor_method_names(type(visitor))]
    if any(is_attribute_hook(name) for _, name in names):
        module.visit(_batched(visitors))  # per-field hooks: LibCST's own walk calls them
        return
    enter: dict[str, list] = {}
    leave: dict[str, list] = {}
    for visitor, name in names:
        kind, _, node_type = name.partition("_")
        (enter if kind == "visit" else leave).setdefault(node_type, []).append(getattr(visitor, name))
    no_methods: tuple = ()

    top_level = {id(statement): index for index, statement in enumerate(module.body)}
    current = -1
    path: list = [None]  # the nodes from the module down to the one being visited
    parents = context.parents

    def on_visit(node) -> None:
        nonlocal current
        key = id(node)
        current = top_level.get(key, current)
        statement_of[key] = current
        parents[key] = path[-1]
        path.append(node)
        kind = type(node).__name__
        if kind in TWIN_KINDS:
            in_order.setdefault((current, kind), []).append(node)
        for method in enter.get(kind, no_methods):
            method(node)

    def on_leave(node) -> None:
        path.pop()
        if node is module:
            context.walk_complete = True
        for method in leave.get(type(node).__name__, no_methods):
            method(node)
        index = top_level.get(id(node))
        if index is not None:
            walked.add(index)

    walk(module, on_visit, on_leave, skipped_types(name for _, name in names))


def _batched(visitors: list):
    """LibCST's walk with every rule's methods (what ``libcst.visit_batched`` does, with the
    method table looked up per class): used when a rule has per-field hooks."""
    import libcst as cst

    class Batched(cst.CSTVisitor):
        def __init__(self) -> None:
            super().__init__()
            self.methods: dict[str, list] = {}
            for visitor in visitors:
                for name in visitor_method_names(type(visitor)):
                    self.methods.setdefault(name, []).append(getattr(visitor, name))

        def on_visit(self, node) -> bool:
            for method in self.methods.get("visit_" + type(node).__name__, ()):
                method(node)
            return True

        def on_leave(self, original_node) -> None:
            for method in self.methods.get("leave_" + type(original_node).__name__, ()):
                method(original_node)

        def on_visit_attribute(self, node, attribute: str) -> None:
            for method in self.methods.get(f"visit_{type(node).__name__}_{attribute}", ()):
                method(node)

        def on_leave_attribute(self, original_node, attribute: str) -> None:
            for method in self.methods.get(f"leave_{type(original_node).__name__}_{attribute}", ()):
                method(original_node)

    return Batched()


def analyze_module(
    module: cst.Module, path: str, rules: list[type[Rule]], config: Config, text: str,
    python_tree: ast.Module | None = None,
) -> Analysis:
    """Run ``rules`` over ``module`` (parsed from ``text``; ``python_tree``: Python's parse of it,
    when the caller has one)."""
    from tfmigrate.cst.names import ImportTable
    from tfmigrate.cst.traversal import index_module
    from tfmigrate.rule import RuleContext

    statement_of: dict[int, int] = {}
    index_module(module, statement_of)  # and forget the last file's nodes
    in_order: dict[tuple[int, str], list] = {}
    walked: set[int] = set()
    context = RuleContext(
        path=path, module=module, imports=ImportTable.from_module(module), target=config.target, tower_input=config.tower_input,
        text=text,
        positions=LazyPositions(module, text, statement_of, in_order, walked, python_tree),
    )
    visitors = [rule(context) for rule in rules]
    needed = [visitor for visitor in visitors if visitor.get_inherited_dependencies()]
    if needed:  # no rule here asks for LibCST metadata, but a new one may
        from libcst.metadata import MetadataWrapper

        # unsafe_skip_copy: the module is ours and never mutated; copying it costs as much as parsing.
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        for visitor in needed:
            visitor.metadata = wrapper.resolve_many(visitor.get_inherited_dependencies())
    _walk_rules(module, visitors, statement_of, in_order, walked, context)
    table = suppressions(text)
    kept = [(r, f, e) for (r, f, e) in context.finish_reports() if not is_suppressed(f, table)]
    kept.sort(key=lambda item: item[1].sort_key())
    return Analysis(module=module, reports=kept, read_paths=frozenset(context.read_paths))


def analyze_source(source: SourceFile, config: Config) -> Analysis | None:
    """Parse and run the rules; None when the prefilter rules the file out."""
    codes = codes_for(source.text, config, source.path)
    if not codes:
        return None  # decided from the catalog: neither LibCST nor any rule is imported
    from tfmigrate.engine.source import parse_source

    if all_rules is registry.all_rules:
        rules = registry.rules_with_codes(codes)
    else:  # rules of a test's own
        rules = [rule for rule in all_rules() if rule.code in codes]
    module = parse_source(source)
    return analyze_module(module, source.path, rules, config, source.text, source.python_tree)


def internal_error(exc: BaseException) -> str:
    """A one-line report of a bug, naming the rule it happened in when there is one."""
    code = None
    rule_module = sys.modules.get("tfmigrate.rule")  # no rule ran if it was never imported
    Rule = getattr(rule_module, "Rule", ())
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame that belongs to a rule
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, Rule):
            code = owner.code
        tb = tb.tb_next
    where = f" in {code}" if code else ""
    # One line: an exception about a syntax tree node prints the whole node.
    detail = " ".join(str(exc).split())
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    return f"internal error{where} ({type(exc).__name__}: {detail}); please report it"


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
    try:
        raw = read_bytes(path)
    except SourceError as exc:
        return FileResult(path=path, error=str(exc))
    return check_bytes(path, raw, config)


def check_bytes(path: str, raw: bytes, config: Config) -> FileResult:
    """`check` of a file's bytes (read from disk, or from stdin under ``--stdin-filename``)."""
    from tfmigrate.engine.cache import content_digest

    result = FileResult(path=path, digest=content_digest(raw))
    notebook = None
    try:
        if is_notebook(path):
            from tfmigrate.engine import notebook as nb

            notebook = nb.load(path, raw)
            result.notes = notebook.notes
            source = notebook.source_file()
        else:
            source = decode_source(path, raw)
        with collector_paused():
            analysis = analyze_source(source, config)
    except SourceError as exc:
        result.error = str(exc)
        return result
    except RecursionError:
        result.error = TOO_DEEP
        return result
    except Exception as exc:  # a bug in a rule must not stop the run over the other files
        result.error = internal_error(exc)
        return result
    if analysis is not None:
        result.parsed = True
        result.findings = [finding for _, finding, _ in analysis.reports]
        result.cacheable = not analysis.read_paths
        if notebook is not None:
            result.findings = [in_cells(f, notebook) for f in result.findings]
    return result


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while one file is analysed, one young-generation
    pass after. A LibCST tree is acyclic (freed by reference counting as soon as it is
    dropped), yet parsing one allocates enough objects to trigger a dozen collections, each
    walking the young tree for nothing: 6-13% of `check`'s CPU on 140-line files. The few
    cycles a file's analysis makes are all young when it ends and go in that one pass."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


def check_text(text: str, config: Config, path: str = "<string>") -> list[Finding]:
    """Findings for a piece of source (used by tests and the rule examples)."""
    source = decode_source(path, text.encode("utf-8"))
    analysis = analyze_source(source, config)
    return [] if analysis is None else [finding for _, finding, _ in analysis.reports]
