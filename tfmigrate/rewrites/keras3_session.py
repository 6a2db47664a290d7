"""A Keras 2 program's TF1 session set-up, spelled with TF2's `tf.config`.

Keras 2 programs gave Keras a session of their own to set how TensorFlow uses the GPUs (the
Keras FAQ's and keras-yolo3's block):

    config = tf.ConfigProto()
    config.gpu_options.allow_growth = True
    sess = tf.Session(config=config)
    set_session(sess)

`tf.ConfigProto` and `tf.Session` exist only in TF1, so the program ran in TF1 mode, where
Keras under a distribution strategy trains otherwise (TFM201 refused it). TF2 sets the same
options process-wide: the block becomes

    for gpu in tf.config.list_physical_devices('GPU'):
        tf.config.experimental.set_memory_growth(gpu, True)

(`log_device_placement` -> `tf.debugging.set_log_device_placement`, `allow_soft_placement` ->
`tf.config.set_soft_device_placement`, the thread counts -> `tf.config.threading`,
`visible_device_list` -> `tf.config.set_visible_devices`; `per_process_gpu_memory_fraction`, a
cap TF2 sets in megabytes only, -> memory growth, with a comment saying so). None of them
changes what is computed. Refused, with the line: another option, and a session or config read
anywhere else (`sess.run`, `K.get_session()` is TF1 code the fix does not move).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.cst.callargs import argument
from tfmigrate.cst.codegen import code_in
from tfmigrate.cst.names import dotted_name
from tfmigrate.cst.traversal import find, module_parents, single_small
from tfmigrate.rewrites.mirrored import TfNames, is_docstring

__all__ = ["SET_SESSION", "SessionSetup", "session_setup"]

#: Keras's `set_session` under each name a Keras 2 program imported it by.
SET_SESSION = ("keras.backend.set_session", "keras.backend.tensorflow_backend.set_session",
               "tensorflow.keras.backend.set_session", "tensorflow.compat.v1.keras.backend.set_session")
SESSIONS = ("tensorflow.Session", "tensorflow.compat.v1.Session", "tensorflow.InteractiveSession")
CONFIGS = ("tensorflow.ConfigProto", "tensorflow.compat.v1.ConfigProto")
GPU_OPTIONS = ("tensorflow.GPUOptions", "tensorflow.compat.v1.GPUOptions")
#: A ConfigProto option (as `config.<path>` or a keyword) -> the TF2 statement that sets it.
TF2_SETTINGS = {
    "gpu_options.allow_growth": "for gpu in {config}.list_physical_devices('GPU'):\n"
                                "    {config}.experimental.set_memory_growth(gpu, {value})\n",
    "log_device_placement": "{debugging}.set_log_device_placement({value})\n",
    "allow_soft_placement": "{config}.set_soft_device_placement({value})\n",
    "intra_op_parallelism_threads": "{config}.threading.set_intra_op_parallelism_threads({value})\n",
    "inter_op_parallelism_threads": "{config}.threading.set_inter_op_parallelism_threads({value})\n",
    # The GPUs the process sees, by index: where there are any (TF1 ignored the list without them).
    "gpu_options.visible_device_list": "gpus = {config}.list_physical_devices('GPU')\n"
                                       "if gpus:\n"
                                       "    {config}.set_visible_devices([gpus[int(i)] for i in str({value}).split(',')], 'GPU')\n",
    # A cap on the GPU memory, which TF2 sets in megabytes only (`memory_limit`): the memory grows as
    # it is needed instead, which changes no result.
    "gpu_options.per_process_gpu_memory_fraction":
        "# per_process_gpu_memory_fraction={value}: TF2 caps GPU memory in MB only (memory_limit); it grows as needed\n"
        "for gpu in {config}.list_physical_devices('GPU'):\n"
        "    {config}.experimental.set_memory_growth(gpu, True)\n",
}


@dataclass
class SessionSetup:
    """What the fix changes: ``changes`` (the set-up statements removed, `set_session(...)`
    replaced by the TF2 settings), the statements it removes (their TF1 calls no longer count),
    and why it cannot, with the node to name the line of."""

    changes: dict = field(default_factory=dict)
    removed: list = field(default_factory=list)
    blocked: tuple[cst.CSTNode, str] | None = None


def session_setup(rule) -> SessionSetup:
    """The module's `set_session(...)` blocks in TF2 (worked out once per module)."""
    def compute() -> SessionSetup:
        found = SessionSetup()
        for call in find(rule.context.module, cst.Call):
            if rule.imports.resolve(call.func) in SET_SESSION:
                _one_block(rule, call, found)
                if found.blocked is not None:
                    return SessionSetup(blocked=found.blocked)
        return found

    return rule.context.memo("keras3.session_setup", compute)


def _one_block(rule, call: cst.Call, found: SessionSetup) -> None:
    """``call`` (`set_session(sess)`) and the statements before it that make its session."""
    parents = module_parents(rule.context)
    line = parents.get(id(parents.get(id(call))))
    block = parents.get(id(line))
    if not (isinstance(single_small(line), cst.Expr) and single_small(line).value is call) or block is None:
        found.blocked = (call, "`set_session(...)` is not a statement of its own: set the TF2 options by hand")
        return
    body = list(block.body)
    session = call.args[0].value if len(call.args) == 1 else None
    maker = _session_function(rule, session)
    if maker is not None:  # `set_session(get_session())`, keras-retinanet's: the function makes it
        made_in, end = list(maker.body.body), len(maker.body.body) - 1
        session = made_in[-1].body[0].value
    else:
        made_in, end = body, body.index(line)
    statements, session = _made_by(rule, made_in, end, session, SESSIONS)
    if session is None or not isinstance(session, cst.Call):
        found.blocked = (call, "the session is not made by `tf.Session(config=...)` in this block: set the TF2 "
                               "options (`tf.config`) by hand")
        return
    config = argument(session, ("target", "graph", "config"), "config")
    more, config = _made_by(rule, made_in, end, config, CONFIGS)
    statements += more
    options = _options(rule, made_in, config, statements, found)
    if found.blocked is not None:
        return
    names = {dotted_name(s.body[0].targets[0].target) for s in statements if isinstance(s.body[0], cst.Assign)}
    if maker is not None:
        extra = [x for x in made_in[:-1] if not is_docstring(x) and not any(x is y for y in statements)]
        if extra:
            found.blocked = (extra[0], f"`{maker.name.value}` does more than make the session")
            return
        names.add(maker.name.value)
        statements = [maker]
    reader = _read_elsewhere(rule, names, [line, *statements])
    if reader is not None:
        found.blocked = (reader, f"`{code_in(rule.context.module, reader)}` is read outside the session set-up, "
                                 "as TF1 code the fix does not move")
        return
    settings = []
    for option, value in options:
        # (after a `pass`: a module's first comment would be its header, not the statement's)
        for setting in cst.parse_module("pass\n" + _setting(rule, option, value)).body[1:]:
            bare = setting.with_changes(leading_lines=())
            same = next((i for i, made in enumerate(settings) if bare.deep_equals(made.with_changes(leading_lines=()))), None)
            if same is None:
                settings.append(setting)
            else:  # memory growth asked twice is set once, under both comments
                settings[same] = settings[same].with_changes(
                    leading_lines=[*settings[same].leading_lines, *setting.leading_lines])
    in_block = [s for s in body if any(s is removed for removed in [line, *statements])]
    if not settings and len(body) == len(in_block):  # the block held the set-up only
        settings = [cst.parse_statement("pass\n")]
    if settings:  # where the set-up began: its blank lines and comments above it stay
        settings[0] = settings[0].with_changes(leading_lines=in_block[0].leading_lines)
    found.changes[line] = cst.FlattenSentinel(settings) if settings else cst.RemovalSentinel.REMOVE
    for statement in statements:
        found.changes[statement] = cst.RemovalSentinel.REMOVE
    found.removed += [line, *statements]


def _session_function(rule, session) -> cst.FunctionDef | None:
    """The module's function that ``session`` (`get_session()`) calls, when it ends by returning
    what it made (`return tf.Session(config=config)`); else None."""
    if not (isinstance(session, cst.Call) and isinstance(session.func, cst.Name) and not session.args):
        return None
    for function in rule.context.module.body:
        if isinstance(function, cst.FunctionDef) and function.name.value == session.func.value:
            last = single_small(function.body.body[-1]) if isinstance(function.body, cst.IndentedBlock) else None
            return function if isinstance(last, cst.Return) and last.value is not None else None
    return None


def _made_by(rule, body: list, end: int, value, makers: tuple) -> tuple[list, cst.BaseExpression | None]:
    """``value`` (a name or a call) resolved to the call of one of ``makers`` that made it in
    ``body`` before ``end``: (the statement that assigned it, if any, the call)."""
    if isinstance(value, cst.Call) and rule.imports.resolve(value.func) in makers:
        return [], value
    if not isinstance(value, cst.Name):
        return [], None
    for statement in reversed(body[:end]):
        small = single_small(statement)
        if isinstance(small, cst.Assign) and any(dotted_name(t.target) == value.value for t in small.targets):
            made = small.value
            ok = len(small.targets) == 1 and isinstance(made, cst.Call) and rule.imports.resolve(made.func) in makers
            return ([statement], made) if ok else ([], None)
    return [], None


def _options(rule, body: list, config, statements: list, found: SessionSetup) -> list[tuple[str, str]]:
    """The options the config sets, by keyword and by `config.<path> = value` lines (those
    lines join ``statements``), in order."""
    if config is None:
        return []
    options = _keyword_options(rule, body, config, statements, found)
    name = next((dotted_name(s.body[0].targets[0].target) for s in statements if isinstance(s.body[0], cst.Assign)
                 and s.body[0].value is config), None)
    for statement in body:
        small = single_small(statement)
        target = dotted_name(small.targets[0].target) if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
        if name is not None and target is not None and target.startswith(name + "."):
            options.append((target[len(name) + 1:], code_in(rule.context.module, small.value)))
            statements.append(statement)
    for option, _ in options:
        if option not in TF2_SETTINGS and found.blocked is None:
            found.blocked = (config, f"the session's `{option}` has no TF2 setting of the same meaning: set it "
                                     "by hand (`tf.config`)")
    return options


def _keyword_options(rule, body: list, made: cst.Call, statements: list, found: SessionSetup,
                     prefix: str = "") -> list[tuple[str, str]]:
    """The options ``made`` (`ConfigProto(...)`) sets by keyword; `gpu_options=tf.GPUOptions(...)`
    (made there or by a line of ``body``, which joins ``statements``) gives `gpu_options.<name>`."""
    options = []
    for arg in made.args:
        if arg.keyword is None:
            found.blocked = (made, f"`{code_in(rule.context.module, made.func)}(...)` is given an argument by position")
            continue
        option = prefix + arg.keyword.value
        more, gpu = _made_by(rule, body, len(body), arg.value, GPU_OPTIONS) if option == "gpu_options" else ([], None)
        if gpu is not None:
            statements += more
            options += _keyword_options(rule, body, gpu, statements, found, "gpu_options.")
        else:
            options.append((option, code_in(rule.context.module, arg.value)))
    return options


def _setting(rule, option: str, value: str) -> str:
    tf = TfNames(rule)  # (the module imports TensorFlow: it made a session with it)
    names = {key: tf(f"tensorflow.{key}") for key in ("config", "debugging")}
    return TF2_SETTINGS[option].format(value=value, **names)


def _read_elsewhere(rule, names: set, statements: list) -> cst.Name | None:
    """A read of one of ``names`` outside ``statements`` (`sess.run(...)`), else None."""
    inside = {id(n) for statement in statements for n in find(statement, cst.Name)}
    return next((n for n in find(rule.context.module, cst.Name) if n.value in names and id(n) not in inside), None)
