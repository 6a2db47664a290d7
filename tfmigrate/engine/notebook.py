"""Jupyter notebooks: their code cells checked and fixed as one Python module.

The code cells are concatenated into one module, as ruff does, so that the imports of the
first cell resolve names in the third. Each cell is preceded by a marker comment
(``# tfmigrate-cell: N``) that tells which lines came from which cell, and IPython syntax
(``%matplotlib inline``, ``!pip install``, ``x = !ls``, ``tf.device?``, a ``%%time`` first line)
is masked line for line by a comment (``# tfmigrate-magic: K``) so that line numbers are kept
and the magic comes back verbatim after a fix. Comments are invisible to the rules, and a fix
keeps the comments outside what it edits, so both kinds of marker survive a fix; if one does
not, the fix is refused rather than guessed.

Cells are numbered from 1 over all cells of the notebook (markdown included), which is the
number Jupyter and VS Code show.

Writing back changes only the ``source`` of the code cells whose code changed; outputs,
metadata, cell ids, key order, indentation and the non-ASCII escaping are kept, so an
unchanged notebook re-serialises to its exact bytes.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from tfmigrate.engine.source import SourceError, SourceFile

CELL_MARKER = "# tfmigrate-cell: {}"
MAGIC_MARKER = "# tfmigrate-magic: {}"
_CELL_LINE = re.compile(r"^# tfmigrate-cell: (\d+)$")
_MAGIC_LINE = re.compile(r"^[ \t]*# tfmigrate-magic: (\d+)$")

# Line magics, shell escapes, help, and the assignment forms ``x = !ls`` / ``x = %who_ls``.
_MAGIC = re.compile(r"^\s*(?:[%!?]|\w+\s*=\s*[%!])|\?\s*$")
# Cell magics whose body is Python: only their first line is masked. Any other cell magic
# (%%bash, %%html, %%writefile ...) makes the whole cell something other than Python.
_PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun", "debug", "snakeviz", "memit", "tensorflow_version"}


@dataclass
class Cell:
    number: int  # 1-based position among all cells
    text: str  # the cell's source, as one string
    masked: list[str] | None  # lines with IPython syntax masked; None: the cell is skipped
    magics: dict[int, str] = field(default_factory=dict)  # magic id -> original line


@dataclass
class Notebook:
    path: str
    raw: bytes
    data: dict
    cells: list[Cell]  # the code cells
    notes: list[str]
    # Concatenated module line (1-based) -> (cell number, line in cell); 0 marks a marker line.
    rows: list[tuple[int, int]]
    text: str  # the concatenated, masked module

    def location(self, row: int) -> tuple[int, int]:
        """(cell, line in cell) of a line of the concatenated module."""
        if 1 <= row <= len(self.rows):
            cell, line = self.rows[row - 1]
            if cell:
                return cell, line
        return (self.cells[0].number if self.cells else 1), 1

    def source_file(self) -> SourceFile:
        return SourceFile(path=self.path, raw=self.raw, text=self.text, encoding="utf-8", bom=False)


def _source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _is_python(data: dict) -> bool:
    metadata = data.get("metadata") or {}
    language = (metadata.get("kernelspec") or {}).get("language") or (metadata.get("language_info") or {}).get("name")
    return language is None or str(language).lower() in ("python", "python3", "ipython")


def _mask(number: int, text: str, next_id: int) -> tuple[list[str] | None, dict[int, str], str | None]:
    """The cell's lines with IPython syntax masked, the masked lines by id, and a note when the
    cell cannot be checked (its lines are then None)."""
    lines = text.split("\n")
    magics: dict[int, str] = {}
    masked: list[str] = []
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        name = first[2:].split(None, 1)[0] if first[2:].strip() else ""
        if name not in _PYTHON_CELL_MAGICS:
            return None, {}, None  # not Python (a %%bash cell ...): nothing to check, nothing to say
    for index, line in enumerate(lines):
        if (index == 0 and first.startswith("%%")) or _MAGIC.search(line):
            indent = line[: len(line) - len(line.lstrip())]
            magics[next_id] = line
            masked.append(indent + MAGIC_MARKER.format(next_id))
            next_id += 1
        else:
            masked.append(line)
    try:
        compile("\n".join(masked), f"<cell {number}>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        if magics:
            return None, {}, f"cell {number}: IPython syntax tfmigrate cannot mask (line {exc.lineno}); cell skipped"
        raise SourceError(f"syntax error in cell {number} at line {exc.lineno}, column {exc.offset or 1}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        return None, {}, f"cell {number}: cannot be parsed; cell skipped"
    return masked, magics, None


def load(path: str, raw: bytes) -> Notebook:
    """Read a notebook's code cells. Raises SourceError when the file is not a notebook."""
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SourceError(f"not a valid notebook (JSON: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise SourceError("not a valid notebook (no cells; nbformat 4 is needed)")
    cells: list[Cell] = []
    notes: list[str] = []
    rows: list[tuple[int, int]] = []
    lines: list[str] = []
    if _is_python(data):
        next_id = 0
        for number, cell in enumerate(data["cells"], start=1):
            if not isinstance(cell, dict) or cell.get("cell_type") != "code":
                continue
            text = _source_text(cell)
            masked, magics, note = _mask(number, text, next_id)
            next_id += len(magics)
            if note:
                notes.append(note)
            cells.append(Cell(number, text, masked, magics))
            if masked is None:
                continue
            lines.append(CELL_MARKER.format(number))
            rows.append((0, 0))
            lines += masked
            rows += [(number, i) for i in range(1, len(masked) + 1)]
    text = "\n".join(lines) + "\n" if lines else ""
    return Notebook(path=path, raw=raw, data=data, cells=cells, notes=notes, rows=rows, text=text)


def cell_lines(path: str) -> dict[int, list[str]]:
    """Each code cell's lines, by cell number (for showing the source of a finding)."""
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8-sig"))
        return {
            number: _source_text(cell).split("\n")
            for number, cell in enumerate(data["cells"], start=1)
            if isinstance(cell, dict) and cell.get("cell_type") == "code"
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def split_cells(notebook: Notebook, new_text: str) -> dict[int, str]:
    """The fixed module cut back into cells (cell number -> new source), magics restored.

    Raises SourceError when a fix moved, merged or dropped a cell boundary or a magic.
    """
    restored: dict[int, list[str]] = {}
    current: list[str] | None = None
    seen_magics: set[int] = set()
    pending: list[str] = []  # lines a fix put before the first marker (added imports)
    magics = {k: v for cell in notebook.cells for k, v in cell.magics.items()}
    for line in new_text.split("\n"):
        cell_match = _CELL_LINE.match(line)
        if cell_match:
            number = int(cell_match.group(1))
            if number in restored:
                raise SourceError("a fix duplicated a notebook cell boundary; notebook left untouched")
            current = restored[number] = pending
            pending = []
            continue
        magic_match = _MAGIC_LINE.match(line)
        if magic_match:
            key = int(magic_match.group(1))
            if key not in magics or key in seen_magics:
                raise SourceError("a fix changed an IPython magic line; notebook left untouched")
            seen_magics.add(key)
            line = magics[key]
        (pending if current is None else current).append(line)
    expected = [c.number for c in notebook.cells if c.masked is not None]
    if list(restored) != expected or seen_magics != set(magics):
        raise SourceError("a fix moved code across notebook cells or dropped a magic; notebook left untouched")
    # The module ends with the newline added after the last cell: drop it again.
    if expected and restored[expected[-1]] and restored[expected[-1]][-1] == "":
        restored[expected[-1]].pop()
    result = {}
    for cell in notebook.cells:
        if cell.masked is None:
            continue
        text = "\n".join(restored[cell.number])
        if text != cell.text:
            result[cell.number] = text
    return result


def _as_source(text: str, like) -> list[str] | str:
    """Jupyter's convention: a list of lines, each but the last keeping its newline."""
    if isinstance(like, str):
        return text
    return text.splitlines(keepends=True)


def _indent_of(text: str) -> int | str | None:
    """The indentation of the first key (Jupyter writes 1 space), or None for one-line JSON."""
    match = re.match(r"\{[ \t]*\r?\n([ \t]*)\"", text)
    if match is None:
        return None
    whitespace = match.group(1)
    return len(whitespace) if set(whitespace) <= {" "} else whitespace


def dump(notebook: Notebook, data: dict) -> bytes:
    """Serialise like the original: its indentation, escaping and final newline."""
    original = notebook.raw.decode("utf-8-sig")
    indent = _indent_of(original)
    ascii_only = not any(ord(c) > 127 for c in original)
    if indent is None:
        compact = not re.search(r'[,:] "', original[:4096])
        text = json.dumps(data, separators=(",", ":") if compact else None, ensure_ascii=ascii_only)
    else:
        text = json.dumps(data, indent=indent, ensure_ascii=ascii_only)
    if original.endswith("\n"):
        text += "\n"
    encoded = text.encode("utf-8")
    return (b"\xef\xbb\xbf" + encoded) if notebook.raw.startswith(b"\xef\xbb\xbf") else encoded


def render(notebook: Notebook, changed: dict[int, str]) -> bytes:
    """The notebook's bytes with the changed cells' sources replaced."""
    data = json.loads(notebook.raw.decode("utf-8-sig"))
    for number, text in changed.items():
        cell = data["cells"][number - 1]
        cell["source"] = _as_source(text, cell.get("source"))
    return dump(notebook, data)


def reproducible(notebook: Notebook) -> bool:
    """Whether writing the notebook back unchanged gives its exact bytes."""
    return dump(notebook, notebook.data) == notebook.raw
