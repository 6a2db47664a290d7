"""What a rule is: a LibCST visitor that carries its own code, documentation and examples.

Modelled on Fixit's ``LintRule``: one class holds the detection logic, the docs that
``tfmigrate explain`` prints (in ruff's fixed sections) and the valid/invalid examples that
the test-suite turns into tests.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence, Union

import libcst as cst

# Plain data, importable without LibCST; re-exported here for the rules.
from tfmigrate.findings import Finding, FixSafety, Location
from tfmigrate.cst.names import ImportTable

if TYPE_CHECKING:
    from libcst.metadata import CodeRange



@dataclass(frozen=True)
class ImportItem:
    """An import a fix needs added or removed: ``import module [as alias]`` or
    ``from module import obj_name [as alias]``. The fix engine hands it to LibCST's
    ``AddImportsVisitor``/``RemoveImportsVisitor``; it is our own small type because importing
    ``libcst.codemod`` (for its ``ImportItem``) costs 0.3 s on every start-up."""

    module: str
    obj_name: str | None = None
    alias: str | None = None

__all__ = ["DEVICE_SCOPE", "DEVICE_WORDS", "FIXED_GPU", "PER_DEVICE", "Edit", "Finding", "FixSafety", "ImportItem", "Invalid", "Location", "Replacement", "Rule", "RuleContext"]


Replacement = Union[cst.CSTNode, cst.FlattenSentinel, cst.RemovalSentinel]


@dataclass
class Edit:
    """A change a rule proposes; the fix engine applies it.

    ``changes`` maps nodes of the parsed module (by identity) to what replaces them. Imports
    go through LibCST's ``AddImportsVisitor``/``RemoveImportsVisitor``, so an existing
    ``import tensorflow as tf`` is reused and an import is only removed when nothing uses it.
    """

    changes: Mapping[cst.CSTNode, Replacement]
    title: str
    add_imports: Sequence[ImportItem] = ()
    remove_imports: Sequence[ImportItem] = ()
    safety: FixSafety | None = None  # defaults to the rule's own


@dataclass
class Invalid:
    """An example the rule must report; ``line`` is where, ``fixed`` what `fix` makes of it."""

    code: str
    line: int | None = None
    fixed: str | None = None
    unsafe: bool = False  # the fix needs --unsafe-fixes


@dataclass
class RuleContext:
    """What a rule knows about the file being checked."""

    path: str
    module: cst.Module
    imports: ImportTable
    target: str = "compat"
    tower_input: str = "keep"  # see engine.config.TOWER_INPUTS
    text: str | None = None  # the module's source, when the runner has it
    reports: list[tuple["Rule", Finding, Edit | None]] = field(default_factory=list)
    #: node -> its ``CodeRange`` (what LibCST's PositionProvider gives), filled by the runner.
    positions: Mapping[cst.CSTNode, "CodeRange"] = field(default_factory=dict)
    _memo: dict[Any, Any] = field(default_factory=dict)
    #: id(node) -> its parent node (the module's parent is None), filled by the runner's walk
    #: as it goes: complete for the node being visited and every node around it.
    parents: dict[int, Any] = field(default_factory=dict)
    #: Set by the runner once its walk has visited every node, before the leave_Module
    #: methods run: from then on `parents` holds every node of the module.
    walk_complete: bool = False
    #: Other files of the project the analysis read (a helper imported from `utils.py`): a
    #: result that depends on them is not cached, since the cache keys on this file alone.
    read_paths: set[str] = field(default_factory=set)
    #: reports whose findings are made once the walk is over (see `Rule.report`)
    _pending: list[tuple["Rule", cst.CSTNode, str, Edit | None]] = field(default_factory=list)

    def finish_reports(self) -> list[tuple["Rule", Finding, Edit | None]]:
        """Make the findings of the reports made during the walk (call it after the walk)."""
        for rule, node, message, edit in self._pending:
            self.reports.append((rule, rule.finding(node, message, edit), edit))
        self._pending.clear()
        return self.reports

    def mentions(self, *words: str) -> bool:
        """Whether the module's source contains any of ``words``: a cheap test that lets an
        analysis skip its walk of a module that cannot hold what it looks for."""
        text = self.text if self.text is not None else self.memo("module.code", lambda: self.module.code)
        return any(word in text for word in words)

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """Share one analysis (say, the module's tower loops) between the rules of a run."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]


def _dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


# The prefilter runs these on every file's text: a branch that starts with a literal lets
# Python's regular expressions jump from one occurrence of it to the next, where one that starts
# with `\b` or a class is tried at every character, ten times slower on a 150-line module. So
# `\bfor\b` is spelled `for\b(?<!\wfor)` and `(?i:gpu:\d)` is `:\d(?<=[gG][pP][uU]:\d)`.

#: A ``requires`` pattern for rules about per-device code: a file that names no GPU, device,
#: replica or tower has none (the words `split` and `shard` alone are in most Python files).
DEVICE_WORDS = r"gpu|GPU|Gpu|[Dd]evice|DEVICE|tower|replica"

#: A ``requires`` pattern for rules about device scopes that are not a CPU pin: the word
#: `device` (`tf.device(...)`, `device_scope`, an imported or aliased `device`, `var.device`)
#: other than in a call on a CPU literal. Most modules of a TF1 project pin their input or
#: variables with `tf.device('/cpu:0')` and define a `num_gpus` flag; none of that can be a
#: tower loop, and such a module is not parsed for those rules.
DEVICE_SCOPE = r"device(?:_scope)?\b(?!\s*\(\s*['\"][^'\"]*cpu:\d+['\"]\s*\))"

#: A ``requires`` pattern for code run once per device without a device scope of its own: a
#: `for` header (loop or comprehension) whose iterable names a device, GPU, tower or replica
#: (`for i in range(FLAGS.num_gpus)`, also broken over lines inside brackets), or a device
#: scope (a tower loop). A module that only defines a `num_gpus` flag has neither.
PER_DEVICE = DEVICE_SCOPE + r"|for\b(?<!\wfor)[^\n]*?\bin\b[^:]*?(?i:gpu|device|tower|replica)"

#: A ``requires`` pattern for a fixed GPU: a device string with an index (`'/gpu:1'`,
#: `'/device:GPU:1'`) or a `DeviceSpec(device_index=1)`.
FIXED_GPU = r":\d(?<=[gG][pP][uU]:\d)|device_index\s*=\s*\d"


class Rule(cst.BatchableCSTVisitor):
    """Base class of every rule in ``tfmigrate.rules``."""

    code: ClassVar[str]
    name: ClassVar[str]
    summary: ClassVar[str]
    #: Any of these words must appear in a file's text for the rule to possibly fire; a file
    #: containing none of the enabled rules' words is not even parsed.
    triggers: ClassVar[tuple[str, ...]]
    #: Regular expressions the text must also match, each of them (narrows the prefilter where
    #: a trigger word is common: `.batch(` of tf.data for the queue batching functions).
    requires: ClassVar[tuple[str, ...]] = ()
    fix_safety: ClassVar[FixSafety] = FixSafety.NONE
    informational: ClassVar[bool] = False  # reported, but does not fail the run

    # Documentation, in the sections of a ruff rule page.
    what_it_finds: ClassVar[str]
    why: ClassVar[str]
    example: ClassVar[str]
    use_instead: ClassVar[str]
    fix_notes: ClassVar[str]

    valid: ClassVar[Sequence[str]] = ()
    invalid: ClassVar[Sequence[Invalid]] = ()

    def __init__(self, context: RuleContext) -> None:
        super().__init__()
        self.context = context

    _visitor_names: ClassVar[dict[type, tuple[str, ...]]] = {}

    def get_visitors(self):
        """LibCST's version inspects every member of the instance, for every file; the
        names of a class's visit_/leave_ methods never change, so look them up once."""
        cls = type(self)
        names = Rule._visitor_names.get(cls)
        if names is None:
            names = tuple(
                name
                for name in dir(cls)
                if name.startswith(("visit_", "leave_"))
                and callable(getattr(cls, name))
                and not getattr(getattr(cls, name), "_is_no_op", False)
            )
            Rule._visitor_names[cls] = names
        return {name: getattr(self, name) for name in names}

    # --- helpers for rule authors -------------------------------------------------------
    @property
    def imports(self) -> ImportTable:
        return self.context.imports

    def qualified(self, node: cst.CSTNode) -> str | None:
        """Canonical dotted name of a Name/Attribute (``tensorflow.train.batch``), if imported."""
        return self.imports.resolve(node)

    def call_name(self, node: cst.CSTNode) -> str | None:
        if isinstance(node, cst.Call):
            return self.qualified(node.func)
        return None

    def tf_ref(self, target: str) -> tuple[cst.BaseExpression, list[ImportItem]]:
        """An expression for a TensorFlow API, reusing the module's own TensorFlow import.

        ``target`` is the full name (``tensorflow.distribute.MirroredStrategy``,
        ``tensorflow.compat.v1.data.make_one_shot_iterator``). With ``import tensorflow as tf``
        it becomes ``tf.distribute.MirroredStrategy``; with ``import tensorflow.compat.v1 as tf``
        the compat prefix is dropped (``tf.data.make_one_shot_iterator``) and plain TF2 names
        are reached through compat.v1, which re-exports ``data``, ``distribute`` and ``nn``.
        When TensorFlow is not imported, the import to add is returned too.
        """
        assert target.startswith("tensorflow.")
        rest = target[len("tensorflow."):]
        bindings = self.imports.bindings
        for alias, module in bindings.items():
            if module in ("tensorflow", "tensorflow.compat.v2") and "." not in alias:
                if module == "tensorflow.compat.v2" and rest.startswith("compat.v1."):
                    continue
                return cst.parse_expression(f"{alias}.{rest}"), []
        for alias, module in bindings.items():
            if module == "tensorflow.compat.v1":
                short = rest[len("compat.v1."):] if rest.startswith("compat.v1.") else rest
                return cst.parse_expression(f"{alias}.{short}"), []
        alias = "tf" if "tf" not in bindings else "tensorflow"
        item = ImportItem("tensorflow", alias="tf") if alias == "tf" else ImportItem("tensorflow")
        return cst.parse_expression(f"{alias}.{rest}"), [item]

    def position(self, node: cst.CSTNode) -> CodeRange:
        # Not LibCST's metadata machinery: positions are computed only for the statements
        # that have a finding (tfmigrate.engine.positions), and libcst.metadata is not imported.
        return self.context.positions[node]

    def report(self, node: cst.CSTNode, message: str, *, edit: Edit | None = None) -> None:
        # The finding (its position) is made when the walk is over: Python's parser then gives
        # most positions without generating the statement's code (tfmigrate.engine.positions).
        self.context._pending.append((self, node, message, edit))

    def finding(self, node: cst.CSTNode, message: str, edit: Edit | None) -> Finding:
        where = self.position(node)
        safety = self.fix_safety
        if edit is not None and edit.safety is not None:
            safety = edit.safety
        return Finding(
            code=self.code,
            name=self.name,
            message=message,
            path=self.context.path,
            start=Location(where.start.line, where.start.column + 1),
            end=Location(where.end.line, where.end.column + 1),
            fix_safety=safety if edit is not None else FixSafety.NONE,
            fix_title=edit.title if edit is not None else None,
            informational=self.informational,
        )

    # --- documentation ------------------------------------------------------------------
    @classmethod
    def documentation(cls) -> str:
        """The rule page, as Markdown (what `tfmigrate explain CODE` prints)."""
        return (
            f"# {cls.code} {cls.name}\n\n{cls.summary}\n\n"
            f"Fix: {cls.fix_safety.value}"
            + (" (informational: does not fail the run)" if cls.informational else "")
            + "\n\n"
            f"## What it finds\n\n{_dedent(cls.what_it_finds)}\n"
            f"## Why it matters\n\n{_dedent(cls.why)}\n"
            f"## Example\n\n```python\n{_dedent(cls.example)}```\n\n"
            f"## Use instead\n\n```python\n{_dedent(cls.use_instead)}```\n\n"
            f"## Fix safety\n\n{_dedent(cls.fix_notes)}"
        )
