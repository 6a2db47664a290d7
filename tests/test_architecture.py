"""The house rules of the code base (README, "Architecture"), checked on the source.

- Floors, lowest first: cst → api (rule.py, findings.py, tf_api.py) → engine → analysis →
  rewrites → rules → cli → verify (which reads only tf_api). A module imports only from its own floor or lower ones
  (lazy imports inside functions count too), so the floors have no import cycles.
- No module imports another module's underscore names (``from x import _y`` or ``x._y``).
- No function longer than 80 lines, but for the listed ones, which may only shrink.
- No two functions with the same body (one copy of each helper).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("cst", "api", "engine", "analysis", "rewrites", "rules", "cli", "verify")
API = {"tfmigrate", "tfmigrate.rule", "tfmigrate.findings", "tfmigrate.tf_api"}
MAX_LINES = 80
# Functions allowed over MAX_LINES, with their length: none are left (issue 15 split the last
# ones at their natural steps). An entry here would need a reason next to it.
LONG_FUNCTIONS: dict[str, int] = {}

# Functions allowed to share a body (none: one copy of each helper).
KNOWN_TWINS: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "rules":
        parts = ["tfmigrate", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


SOURCES = {
    _module_name(path): path
    for path in sorted([*ROOT.glob("tfmigrate/**/*.py"), *ROOT.glob("rules/*.py")])
}
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in SOURCES.items()}


def floor_of(module: str) -> str:
    if module in API:
        return "api"
    if module == "tfmigrate.__main__":
        return "cli"
    package = module.split(".")[1]
    if package not in FLOORS:
        raise AssertionError(f"{module}: not on any floor; put it in a package (see README, Architecture)")
    return package


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    is_package = SOURCES[importer].name == "__init__.py"
    base = package[: len(package) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str):
    """(imported module, [(name, lineno)]) for every tfmigrate import in ``module``: a name
    that is a module itself (``from tfmigrate.rewrites import mirrored``) counts as that module."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tfmigrate"):
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("tfmigrate"):
                continue
            plain = []
            for alias in node.names:
                if f"{source}.{alias.name}" in SOURCES:
                    yield f"{source}.{alias.name}", [], node.lineno
                else:
                    plain.append(alias.name)
            if plain:
                yield source, plain, node.lineno


def test_every_module_is_on_a_floor():
    for module in SOURCES:
        floor_of(module)


def test_no_import_goes_up_a_floor():
    upward = []
    for module in SOURCES:
        mine = FLOORS.index(floor_of(module))
        for target, _, line in imports(module):
            if FLOORS.index(floor_of(target)) > mine:
                upward.append(f"{SOURCES[module].relative_to(ROOT)}:{line}: {floor_of(module)} imports "
                              f"{target} ({floor_of(target)})")
    assert not upward, "\n".join(upward)


def test_floors_have_no_import_cycles():
    edges = {floor: set() for floor in FLOORS}
    for module in SOURCES:
        for target, _, _ in imports(module):
            if floor_of(target) != floor_of(module):
                edges[floor_of(module)].add(floor_of(target))
    done: set[str] = set()

    def visit(floor: str, path: tuple[str, ...]) -> None:
        assert floor not in path, f"import cycle between floors: {' -> '.join((*path, floor))}"
        if floor not in done:
            for lower in edges[floor]:
                visit(lower, (*path, floor))
            done.add(floor)

    for floor in FLOORS:
        visit(floor, ())


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_modules_private_names():
    found = []
    for module, tree in TREES.items():
        where = SOURCES[module].relative_to(ROOT)
        module_aliases = {}  # local name -> imported tfmigrate module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tfmigrate"):
                        module_aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, node)
                for alias in node.names:
                    if f"{source}.{alias.name}" in SOURCES:
                        module_aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif source.startswith("tfmigrate") and source != module and _private(alias.name):
                        found.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = ast.unparse(node.value)
                if dotted in module_aliases and module_aliases[dotted] != module:
                    found.append(f"{where}:{node.lineno}: {dotted}.{node.attr}")
    assert not found, "\n".join(found)


def _functions():
    for module, tree in TREES.items():
        where = SOURCES[module].relative_to(ROOT).as_posix()

        def visit(node: ast.AST, prefix: str):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qualified = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        yield f"{where}::{qualified}", child
                    yield from visit(child, qualified + ".")
                else:
                    yield from visit(child, prefix)

        yield from visit(tree, "")


def test_no_function_over_80_lines():
    too_long = []
    lengths = {}
    for name, function in _functions():
        length = function.end_lineno - function.lineno + 1
        lengths[name] = length
        if length > MAX_LINES and length > LONG_FUNCTIONS.get(name, MAX_LINES):
            listed = f" (listed at {LONG_FUNCTIONS[name]})" if name in LONG_FUNCTIONS else ""
            too_long.append(f"{name}: {length} lines{listed}")
    assert not too_long, "functions over 80 lines: split them at their natural steps\n" + "\n".join(too_long)
    stale = [name for name, length in LONG_FUNCTIONS.items() if lengths.get(name, 0) <= MAX_LINES]
    assert not stale, f"no longer over {MAX_LINES} lines: drop from LONG_FUNCTIONS: {stale}"


def _body_shape(function: ast.AST) -> str | None:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    if not body:
        return None
    return ast.dump(ast.Module(body=body, type_ignores=[])) + ast.dump(function.args)


def test_no_helper_defined_twice():
    shapes: dict[str, list[str]] = {}
    for name, function in _functions():
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and "." not in name.split("::")[1]:
            shape = _body_shape(function)
            if shape is not None and function.end_lineno - function.lineno >= 2:  # a one-liner may repeat
                shapes.setdefault(shape, []).append(name)
    twice = [" = ".join(names) for names in shapes.values() if len(names) > 1 and not set(names) <= KNOWN_TWINS]
    assert not twice, "the same function twice: keep one and import it\n" + "\n".join(twice)

