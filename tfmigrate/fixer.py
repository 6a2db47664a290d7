"""The fix engine: apply the rules' edits, re-run until nothing changes, never write a bad file.

Rules propose ``Edit``s (node replacements plus imports); this module applies the ones the
user allowed (safe, or unsafe with ``--unsafe-fixes``), re-runs every rule on the result (a fix
may expose or enable another), and stops after ``MAX_PASSES``. The result must parse before
anything is written, and it is written atomically.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider

from tfmigrate.config import Config
from tfmigrate.rule import Edit, Finding, FixSafety, Rule
from tfmigrate.runner import analyze_source, in_cells, internal_error, is_notebook
from tfmigrate.source import SourceError, SourceFile, decode_source, read_bytes, write_atomic

MAX_PASSES = 8


@dataclass
class FixResult:
    path: str
    source: SourceFile | None = None
    new_text: str | None = None  # None: nothing changed
    fixed: list[Finding] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)
    error: str | None = None
    written: bool = False
    notes: list[str] = field(default_factory=list)
    # A notebook: cell number -> (old source, new source) of the cells that change, and the
    # notebook's new bytes.
    cells: dict[int, tuple[str, str]] | None = None
    notebook_bytes: bytes | None = None

    @property
    def changed(self) -> bool:
        return self.new_text is not None

    def diff(self) -> str:
        if self.source is None or self.new_text is None:
            return ""
        if self.cells is not None:
            return "".join(
                "".join(difflib.unified_diff(
                    (old + "\n").splitlines(keepends=True), (new + "\n").splitlines(keepends=True),
                    fromfile=f"{self.path}:cell {number}", tofile=f"{self.path}:cell {number}",
                ))
                for number, (old, new) in sorted(self.cells.items())
            )
        return "".join(difflib.unified_diff(
            self.source.text.splitlines(keepends=True), self.new_text.splitlines(keepends=True),
            fromfile=self.path, tofile=self.path,
        ))


def allowed(safety: FixSafety, unsafe: bool) -> bool:
    return safety == FixSafety.SAFE or (unsafe and safety == FixSafety.UNSAFE)


class _ApplyChanges(cst.CSTTransformer):
    """Replaces nodes by identity with what the edits say."""

    def __init__(self, changes: dict[int, object]) -> None:
        super().__init__()
        self.changes = changes

    def on_leave(self, original_node, updated_node):
        return self.changes.get(id(original_node), updated_node)


def _spans(module: cst.Module, edit: Edit, positions) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    spans = []
    for node in edit.changes:
        where = positions.get(node)
        if where is None:  # a node that is not in this module: the rule has a bug
            raise ValueError("edit refers to a node outside the module")
        spans.append(((where.start.line, where.start.column), (where.end.line, where.end.column)))
    return spans


def _overlaps(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def apply_edits(module: cst.Module, edits: list[Edit]) -> tuple[cst.Module, list[int]]:
    """Apply the edits that do not overlap an earlier one; return the module and which were applied.

    Overlapping edits are left for the next pass, when they are recomputed on the new code.
    """
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    taken: list = []
    changes: dict[int, object] = {}
    applied: list[int] = []
    context = CodemodContext()
    for index, edit in enumerate(edits):
        spans = _spans(module, edit, positions)
        if any(_overlaps(s, t) for s in spans for t in taken):
            continue
        taken += spans
        applied.append(index)
        changes.update({id(node): replacement for node, replacement in edit.changes.items()})
        for item in edit.add_imports:
            AddImportsVisitor.add_needed_import(context, item.module, item.obj_name, item.alias)
    if not applied:
        return module, applied
    new_module = module.visit(_ApplyChanges(changes))
    if context.scratch.get(AddImportsVisitor.CONTEXT_KEY):
        new_module = AddImportsVisitor(context).transform_module(new_module)
    removals = [item for i in applied for item in edits[i].remove_imports]
    if removals:
        remove_context = CodemodContext()
        for item in removals:
            RemoveImportsVisitor.remove_unused_import(remove_context, item.module, item.obj_name, item.alias)
        new_module = RemoveImportsVisitor(remove_context).transform_module(new_module)
    return new_module, applied


def fix_source(source: SourceFile, config: Config, *, unsafe: bool = False) -> FixResult:
    """Fix one source in memory. Raises SourceError when it cannot be parsed."""
    result = FixResult(path=source.path, source=source)
    current = source
    for _ in range(MAX_PASSES):
        analysis = analyze_source(current, config)
        if analysis is None:
            break
        candidates: list[tuple[Rule, Finding, Edit]] = [
            (rule, finding, edit)
            for rule, finding, edit in analysis.reports
            if edit is not None and allowed(finding.fix_safety, unsafe)
        ]
        if not candidates:
            result.remaining = [finding for _, finding, _ in analysis.reports]
            break
        new_module, applied = apply_edits(analysis.module, [edit for _, _, edit in candidates])
        new_text = new_module.code
        codes = sorted({candidates[i][0].code for i in applied})
        try:
            cst.parse_module(new_text)
        except cst.ParserSyntaxError:
            raise SourceError(
                f"internal error: the fix of {', '.join(codes)} would not parse; file left untouched, please report it"
            ) from None
        if new_text == current.text:
            result.remaining = [finding for _, finding, _ in analysis.reports]
            break
        result.fixed += [candidates[i][1] for i in applied]
        current = SourceFile(
            path=source.path, raw=source.raw, text=new_text, encoding=source.encoding, bom=source.bom
        )
    else:
        analysis = analyze_source(current, config)
        result.remaining = [] if analysis is None else [finding for _, finding, _ in analysis.reports]
    if current.text != source.text:
        result.new_text = current.text
    return result


def _fix_notebook(path: str, raw: bytes, config: Config, unsafe: bool) -> FixResult:
    from tfmigrate import notebook as nb

    notebook = nb.load(path, raw)
    result = fix_source(notebook.source_file(), config, unsafe=unsafe)
    result.notes = notebook.notes
    # Counted in the summary only; locations of later passes are approximate, which is fine there.
    result.fixed = [in_cells(f, notebook) for f in result.fixed]
    if result.changed:
        changed = nb.split_cells(notebook, result.new_text)
        old = {cell.number: cell.text for cell in notebook.cells}
        result.cells = {number: (old[number], text) for number, text in changed.items()}
        result.notebook_bytes = nb.render(notebook, changed)
    return result


def fix_file(path: str, config: Config, *, unsafe: bool = False, write: bool = False) -> FixResult:
    try:
        raw = read_bytes(path)
        if is_notebook(path):
            result = _fix_notebook(path, raw, config, unsafe)
        else:
            result = fix_source(decode_source(path, raw), config, unsafe=unsafe)
    except SourceError as exc:
        return FixResult(path=path, error=str(exc))
    except Exception as exc:  # a bug in a rule must not stop the run over the other files
        return FixResult(path=path, error=internal_error(exc) + "; file left untouched")
    if write and result.changed:
        data = result.notebook_bytes if result.notebook_bytes is not None else result.source.encode(result.new_text)
        try:
            if not os.access(path, os.W_OK):
                raise SourceError("file is read-only; not fixed")
            write_atomic(path, data, expected_original=raw)
            result.written = True
        except SourceError as exc:
            result.error = str(exc)
        except OSError as exc:
            result.error = f"could not write ({exc.strerror or exc}); file left untouched"
    return result


def fix_text(text: str, config: Config, *, unsafe: bool = False, path: str = "<string>") -> str:
    """The fixed version of a piece of source (for tests and rule examples)."""
    result = fix_source(decode_source(path, text.encode("utf-8")), config, unsafe=unsafe)
    return result.new_text if result.changed else text
