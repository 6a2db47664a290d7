"""Towers built by a ``while`` counter loop or by a comprehension become the ``for`` loop they
mean, and then MirroredStrategy through the tower rewrite::

    gpu = 0
    while gpu < num_gpus:                        for gpu in range(num_gpus):
        with tf.device('/gpu:%d' % gpu):   ->        with tf.device('/gpu:%d' % gpu):
            ...                                          ...
        gpu += 1

    towers = [build_tower(i) for i in range(n)]  ->  towers = []
                                                     for i in range(n):
                                                         towers.append(build_tower(i))

The ``for`` loop is only a step: the edit is offered when the tower rewrite takes the loop it
makes, which is found out by running TFM101 on the module with the loop rewritten (a trial);
otherwise the finding carries the tower rewrite's own refusal, its lines those of the file as
it is. The ``fix`` run's next pass then rewrites the ``for`` loop as any other.
"""

from __future__ import annotations

import contextvars
import difflib
import re
from pathlib import Path

import libcst as cst

from tfmigrate.analysis.tower_forms import TowerForm, counter_of
from tfmigrate.cst.callargs import is_zero
from tfmigrate.cst.codegen import code
from tfmigrate.cst.flow import first_reader
from tfmigrate.cst.traversal import children, fresh_name, module_parents, names_used, single_small, walk
from tfmigrate.engine.config import Config
from tfmigrate.engine.runner import analyze_module
from tfmigrate.rewrites.refusal import Refused
from tfmigrate.rule import Edit

__all__ = ["plan"]

# Set while a trial runs TFM101 on the rewritten module: the forms found there are reported
# without a trial of their own (each trial would otherwise start another).
_IN_TRIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("tower_form_trial", default=False)


def plan(rule, form: TowerForm, message: str) -> tuple[str, Edit | None]:
    """(The finding's message, the edit) for a tower loop in another form than ``for``:
    ``message`` is what TFM101 says of a tower loop; the tower rewrite's refusal is added."""
    label = ("towers built by a comprehension" if form.kind == "comprehension"
             else f"tower loop written as `while {code(form.statement.test)}`")
    message = message.replace("tower loop", label, 1)
    try:
        changes, loop, title = (_as_for_comprehension if form.kind == "comprehension" else _as_for_while)(rule, form)
    except Refused as reason:
        return f"{message} (no automatic fix: {reason})", None
    if _IN_TRIAL.get():
        return f"{message} (no automatic fix: rewritten once the loop around it is)", None
    finding, edit, rewritten = _trial(rule, changes, loop)
    if finding is None:  # the rewritten module has no tower loop there: a bug, never an edit
        return f"{message} (no automatic fix: the `for` loop it means is not a tower loop)", None
    reason = finding.message.partition("(no automatic fix: ")[2].rstrip(")")
    if edit is None:
        return f"{message} (no automatic fix: {_original_lines(reason, rule.context.module.code, rewritten)})", None
    return message, Edit(changes=changes, title=f"{title}, then: {edit.title}", safety=finding.fix_safety)


# --- `while i < n: ...; i += 1` ---------------------------------------------------------------


def _as_for_while(rule, form: TowerForm):
    loop: cst.While = form.statement
    counter, bound, inclusive = counter_of(loop.test)
    body = list(loop.body.body)
    if loop.orelse is not None:
        raise Refused("the `while` loop has an `else` block")
    step = single_small(body[-1]) if body else None
    if not (isinstance(step, cst.AugAssign) and code(step).replace(" ", "") == f"{counter}+=1"):
        raise Refused(f"the counter `{counter}` is not stepped by `{counter} += 1` at the end of the loop body")
    for node in walk(cst.IndentedBlock(body=body[:-1])):
        changed = _binds(node) & ({counter} | names_used(bound))
        if changed:
            raise Refused(f"line {_line(rule, node)}: the loop body rebinds `{sorted(changed)[0]}`, which the loop "
                          "test reads")
    if _continues(body[:-1]):
        raise Refused("a `continue` in the loop body would skip the counter's step")
    block, index = _place(rule, loop)
    start = _start(rule, loop, counter)
    if start is None:
        raise Refused(f"cannot tell where the counter `{counter}` starts (no `{counter} = 0` before the loop)")
    reader = _read_after(rule, loop, {counter})
    if reader is not None:
        raise Refused(f"line {_line(rule, reader)} reads the counter `{counter}` after the loop "
                      "(a `for` loop would leave it one lower)")
    limit = f"{code(bound)} + 1" if inclusive else code(bound)
    header = f"for {counter} in range({limit}):\n    pass\n"
    new_loop = cst.parse_statement(header).with_changes(body=loop.body.with_changes(body=body[:-1]),
                                                        leading_lines=loop.leading_lines)
    changes: dict = {}
    if index and block[index - 1] is start:  # `gpu = 0` right above the loop: the `for` loop binds it now
        changes[start] = cst.RemovalSentinel.REMOVE
        new_loop = new_loop.with_changes(leading_lines=[*start.leading_lines, *loop.leading_lines])
    changes[loop] = new_loop
    return changes, new_loop, f"rewrite the counter loop as `for {counter} in range({limit})`"


def _binds(node: cst.CSTNode) -> set[str]:
    """Names ``node`` itself binds (an assignment target, a loop or `as` target, `:=`)."""
    if isinstance(node, cst.AsName):
        return names_used(node.name)
    if isinstance(node, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.NamedExpr)):
        return names_used(node.target)
    return set()


def _continues(statements) -> bool:
    """A `continue` of this loop (not of a loop nested in it)."""
    stack = list(statements)
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Continue):
            return True
        if not isinstance(node, (cst.For, cst.While, cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            stack.extend(children(node))
    return False


def _start(rule, loop: cst.While, counter: str) -> cst.BaseStatement | None:
    """The `counter = 0` the loop starts from: the last statement before it (in its block, then
    in the blocks around it, up to its function) that mentions the counter, else None."""
    for block, index in _blocks_around(rule, loop):
        for statement in reversed(block[:index]):
            if counter in names_used(statement):
                small = single_small(statement)
                starts = (isinstance(small, cst.Assign) and len(small.targets) == 1
                          and code(small.targets[0].target) == counter and is_zero(small.value))
                return statement if starts else None
    return None


# --- `[tower(i) for i in range(n)]` -----------------------------------------------------------


def _as_for_comprehension(rule, form: TowerForm):
    comprehension = form.comprehension
    comp = comprehension.for_in
    if comp.inner_for_in is not None or comp.ifs or comp.asynchronous is not None:
        raise Refused("the comprehension has more than one plain `for` clause")
    statement = form.statement
    small = single_small(statement)
    if small is None or not isinstance(statement, cst.SimpleStatementLine):
        raise Refused("the comprehension is not in a statement of its own")
    _place(rule, statement)  # a statement of a block (not a one-line `if x: y = [...]` body)
    reader = _read_after(rule, statement, names_used(comp.target))
    if reader is not None:
        raise Refused(f"line {_line(rule, reader)} reads `{code(comp.target)}`, which a `for` loop would leave bound")
    whole = (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
             and small.value is comprehension and isinstance(comprehension, cst.ListComp))
    results = small.targets[0].target.value if whole else fresh_name(rule.context.module, "tower_results")
    loop = cst.parse_statement(f"for {code(comp.target)} in {code(comp.iter)}:\n    {results}.append({code(comprehension.elt)})\n")
    # A blank line above it: the tower rewrite puts a function in the loop's place.
    loop = loop.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    first = cst.parse_statement(f"{results} = []\n").with_changes(leading_lines=statement.leading_lines)
    lines = [first, loop]
    if not whole:
        kept = statement.deep_replace(comprehension, cst.Name(results)).with_changes(leading_lines=())
        lines.append(kept)
    return {statement: cst.FlattenSentinel(lines)}, loop, f"build the towers with `for {code(comp.target)} in {code(comp.iter)}`"


# --- where the statement is, and who reads what after it ----------------------------------------


def _blocks_around(rule, statement: cst.BaseStatement):
    """(The statements of a block, the index there of ``statement`` or of the statement holding
    it), for its own block and each block around it, out to its function's."""
    parents = module_parents(rule.context)
    current = statement
    while current is not None and not isinstance(current, (cst.FunctionDef, cst.Module)):
        parent = parents.get(id(current))
        block = getattr(parent, "body", None)
        if isinstance(block, (list, tuple)):
            index = next((i for i, s in enumerate(block) if s is current), None)
            if index is not None:
                yield list(block), index
        current = parent


def _place(rule, statement: cst.BaseStatement):
    """(The statements of the block ``statement`` is in, its index there)."""
    found = next(_blocks_around(rule, statement), None)
    if found is None or found[0][found[1]] is not statement:
        raise Refused("the loop is not in a block of statements")
    return found


def _read_after(rule, statement: cst.BaseStatement, names: set[str]) -> cst.CSTNode | None:
    """The first statement after ``statement`` (in its block, then in the blocks around it up
    to its function) that reads one of ``names`` before binding it again, else None."""
    pending = set(names)
    for block, index in _blocks_around(rule, statement):
        reader = first_reader(block[index + 1:], pending)
        if reader is not None or not pending:
            return reader
    return None


def _line(rule, node: cst.CSTNode) -> int:
    return rule.position(node).start.line


# --- the trial ----------------------------------------------------------------------------------


def _trial(rule, changes: dict, loop: cst.For):
    """TFM101's finding and edit at ``loop`` once ``changes`` are made to the module, and the
    module's code then."""
    # Imported here: only a module with a tower in another form needs the fixer and LibCST's
    # metadata, and `check` of one file must not pay for them.
    from libcst.metadata import MetadataWrapper, PositionProvider

    from tfmigrate.engine.fixer import apply_edits

    module, _ = apply_edits(rule.context.module, [Edit(changes=changes, title="")])
    line = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)[loop].start.line
    config = Config(root=Path.cwd(), select=[rule.code], target=rule.context.target, tower_input=rule.context.tower_input)
    token = _IN_TRIAL.set(True)
    try:
        analysis = analyze_module(module, rule.context.path, [type(rule)], config, module.code)
    finally:
        _IN_TRIAL.reset(token)
    for _, finding, edit in analysis.reports:
        if finding.start.row == line:
            return finding, edit, module.code
    return None, None, module.code


_LINES = re.compile(r"\b(lines? )(\d+(?:(?:, | and )\d+)*)")


def _original_lines(message: str, original: str, rewritten: str) -> str:
    """``message``, said of the ``rewritten`` module, with its line numbers those of the ``original``."""
    old, new = original.splitlines(), rewritten.splitlines()
    back: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        for j in range(j1, j2):
            back[j + 1] = (i1 + (j - j1) if tag == "equal" else i1) + 1
    return _LINES.sub(lambda m: m.group(1) + re.sub(r"\d+", lambda n: str(back.get(int(n.group()), n.group())), m.group(2)),
                      message)
