"""The fix engine: apply the rules' edits, re-run until nothing changes, never write a bad file.

Rules propose ``Edit``s (node replacements plus imports); this module applies the ones the
user allowed (safe, or unsafe with ``--unsafe-fixes``), re-runs every rule on the result (a fix
may expose or enable another), and stops after ``MAX_PASSES``. The result must parse before
anything is written, and it is written atomically.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider

from tfmigrate.engine.config import Config
from tfmigrate.rule import Edit, Finding, FixSafety, Rule
from tfmigrate.engine.runner import (
    TOO_DEEP, analyze_source, collector_paused, in_cells, internal_error, is_notebook,
)
from tfmigrate.engine.source import (
    SourceError, SourceFile, compile_error, compile_failure, decode_source, libcst_parse, read_bytes,
    interrupts_held, write_atomic,
)

MAX_PASSES = 8


@dataclass
class FixResult:
    path: str
    source: SourceFile | None = None
    new_text: str | None = None  # None: nothing changed
    fixed: list[Finding] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)  # where they are in the fixed text
    # The same findings where they are in the file as it was, when found there: what a run
    # that writes nothing reports (the fixed text's line numbers are not the user's).
    remaining_before: list[Finding] | None = None
    error: str | None = None
    skipped: str | None = None  # why a file was deliberately left alone (not an error)
    written: bool = False
    notes: list[str] = field(default_factory=list)
    # A notebook: cell number -> (old source, new source) of the cells that change, and the
    # notebook's new bytes.
    cells: dict[int, tuple[str, str]] | None = None
    notebook_bytes: bytes | None = None

    @property
    def changed(self) -> bool:
        return self.new_text is not None

    def fixed_bytes(self) -> bytes:
        """The bytes to write for the fixed file; SourceError when they would not read back."""
        if self.notebook_bytes is not None:
            return self.notebook_bytes
        return _encoded(self.source, self.new_text)

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

    Overlapping edits are left for the next pass, when they are recomputed on the new code. One
    edit shared by several findings (a rewrite of towers built across several loops) applies
    once and counts for each of them.
    """
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    taken: list = []
    changes: dict[int, object] = {}
    applied: list[int] = []
    context = CodemodContext()
    for index, edit in enumerate(edits):
        if any(edits[earlier] is edit for earlier in applied):
            applied.append(index)
            continue
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
    unique = {id(edits[i]): edits[i] for i in applied}.values()
    removals = [item for edit in unique for item in edit.remove_imports]
    if removals:
        remove_context = CodemodContext()
        for item in removals:
            RemoveImportsVisitor.remove_unused_import(remove_context, item.module, item.obj_name, item.alias)
        new_module = RemoveImportsVisitor(remove_context).transform_module(new_module)
    return new_module, applied


def _first_difference(a: str, b: str) -> int:
    """The line number (1-based) where two texts first differ."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a.count("\n", 0, index) + 1


def _check_round_trip(module: cst.Module, text: str) -> None:
    """LibCST must give back the text it parsed, or the untouched parts of a fixed file would
    change too (LibCST 1.x drops a form feed that starts a statement line)."""
    code = module.code
    if code != text:
        line = _first_difference(code, text)
        lines = text.split("\n")  # not splitlines(): it splits at form feeds too
        what = " (a form feed starts it)" if line <= len(lines) and "\f" in lines[line - 1] else ""
        raise SourceError(
            f"cannot rewrite this file without changing line {line}{what}: LibCST does not reproduce it "
            "byte for byte; file left untouched"
        )


def fix_source(source: SourceFile, config: Config, *, unsafe: bool = False) -> FixResult:
    """Fix one source in memory. Raises SourceError when it cannot be parsed, or when the
    result would change anything outside the fixed statements or would not compile."""
    result = FixResult(path=source.path, source=source)
    current = source
    first_reports = None
    for _ in range(MAX_PASSES):
        analysis = analyze_source(current, config)
        if analysis is None:
            break
        if first_reports is None:
            first_reports = [finding for _, finding, _ in analysis.reports]
        candidates: list[tuple[Rule, Finding, Edit]] = [
            (rule, finding, edit)
            for rule, finding, edit in analysis.reports
            if edit is not None and allowed(finding.fix_safety, unsafe)
        ]
        if not candidates:
            result.remaining = [finding for _, finding, _ in analysis.reports]
            break
        if current is source:  # about to change it: it must compile, and survive LibCST intact
            failure = compile_failure(source)
            if failure is not None:
                raise failure
            _check_round_trip(analysis.module, source.text)
        new_module, applied = apply_edits(analysis.module, [edit for _, _, edit in candidates])
        new_text = new_module.code
        codes = sorted({candidates[i][0].code for i in applied})
        try:  # both parsers: LibCST accepts a few things Python does not
            libcst_parse(new_text)
            broken = compile_error(new_text, source.path) is not None
        except cst.ParserSyntaxError:
            broken = True
        if broken:
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
        result.remaining_before = _as_before(result.remaining, first_reports or [])
    return result


def _as_before(remaining: list[Finding], before: list[Finding]) -> list[Finding]:
    """Each remaining finding as the first pass reported it on the unchanged file (same code,
    same message but for the line numbers it cites), else as it is."""
    def shape(finding: Finding) -> tuple[str, str]:
        return finding.code, re.sub(r"\d+", "#", finding.message)

    earlier: dict[tuple[str, str], list[Finding]] = {}
    for finding in before:
        earlier.setdefault(shape(finding), []).append(finding)
    found = []
    for finding in remaining:
        matches = earlier.get(shape(finding))
        found.append(matches.pop(0) if matches else finding)
    return found


def _fix_notebook(path: str, raw: bytes, config: Config, unsafe: bool) -> FixResult:
    from tfmigrate.engine import notebook as nb

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


def _outside(path: str, within: tuple[str, ...]) -> bool:
    """A symlink whose target is not under any of the paths given (their real paths)."""
    if not within or not os.path.islink(path):
        return False
    target = os.path.realpath(path)
    return not any(target == root or target.startswith(root.rstrip(os.sep) + os.sep) for root in within)


def _encoded(source: SourceFile, text: str) -> bytes:
    """The bytes to write for ``text``: they must read back as ``text`` (same encoding found
    from the same BOM or coding cookie), or nothing is written."""
    try:
        data = source.encode(text)
        if decode_source(source.path, data).text == text:
            return data
    except (UnicodeError, SourceError):
        pass
    raise SourceError(
        f"internal error: the fixed text would not read back as {source.encoding}; file left untouched, please report it"
    )


def fix_bytes(path: str, raw: bytes, config: Config, *, unsafe: bool = False) -> FixResult:
    """Fix a file's bytes in memory (read from disk, or standard input); errors in the result."""
    try:
        with collector_paused():
            if is_notebook(path):
                return _fix_notebook(path, raw, config, unsafe)
            return fix_source(decode_source(path, raw), config, unsafe=unsafe)
    except SourceError as exc:
        return FixResult(path=path, error=str(exc))
    except RecursionError:
        return FixResult(path=path, error=TOO_DEEP.replace("not checked", "file left untouched"))
    except Exception as exc:  # a bug in a rule must not stop the run over the other files
        return FixResult(path=path, error=internal_error(exc) + "; file left untouched")


class InterruptedAfterWrite(KeyboardInterrupt):
    """Ctrl-C that came while a file was written: the write ended first, and ``result`` says
    so, for the count of files written that the run prints as it stops."""

    def __init__(self, result: FixResult) -> None:
        super().__init__()
        self.result = result


def fix_file(
    path: str, config: Config, *, unsafe: bool = False, write: bool = False, within: tuple[str, ...] = (),
) -> FixResult:
    """Fix one file (written only with ``write``). ``within``: the real paths of the paths the
    user gave; a symlink found in them that points outside all of them is not fixed."""
    try:
        raw = read_bytes(path)
        if _outside(path, within):
            analysis = None if is_notebook(path) else analyze_source(decode_source(path, raw), config)
            return FixResult(
                path=path, skipped=f"symlink to {os.path.realpath(path)}, outside the paths given; not fixed",
                remaining=[] if analysis is None else [finding for _, finding, _ in analysis.reports],
            )
    except SourceError as exc:
        return FixResult(path=path, error=str(exc))
    except Exception as exc:  # RecursionError included: not fixed, the run goes on
        return FixResult(path=path, error=internal_error(exc) + "; file left untouched")
    result = fix_bytes(path, raw, config, unsafe=unsafe)
    if write and result.changed and not result.error:
        try:
            data = result.fixed_bytes()
            if not os.access(path, os.W_OK) and os.path.exists(path):  # a deleted file: write_atomic says so
                raise SourceError("file is read-only; not fixed")
            _write(path, data, raw, result)
        except SourceError as exc:
            result.error = str(exc)
        except OSError as exc:
            result.error = f"could not write ({exc.strerror or exc}); file left untouched"
    return result


def _write(path: str, data: bytes, raw: bytes, result: FixResult) -> None:
    """Write the fixed file and mark ``result`` written, with Ctrl-C held until both are done:
    an interrupt that came meanwhile is raised as :class:`InterruptedAfterWrite`."""
    try:
        with interrupts_held():
            write_atomic(path, data, expected_original=raw)
            result.written = True
    except KeyboardInterrupt:
        if result.written:
            raise InterruptedAfterWrite(result) from None
        raise


def fix_text(text: str, config: Config, *, unsafe: bool = False, path: str = "<string>") -> str:
    """The fixed version of a piece of source (for tests and rule examples)."""
    result = fix_source(decode_source(path, text.encode("utf-8")), config, unsafe=unsafe)
    return result.new_text if result.changed else text
