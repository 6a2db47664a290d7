"""The Coordinator / `start_queue_runners` scaffolding of a module's queue input: what goes
once every queue is a tf.data pipeline (``tfmigrate.rewrites.pipelines`` asks), and the uses of
the coordinator and threads that must be scaffolding too."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from tfmigrate.cst.traversal import find, names_used, single_small
from tfmigrate.cst.walker import visit_read_only
from tfmigrate.rewrites.queue_syntax import COORDINATOR, START_QUEUE_RUNNERS, Blocked, assignment

@dataclass
class ScaffoldPlan:
    remove: set[int] = field(default_factory=set)  # statements (ids) that go
    reraise: set[int] = field(default_factory=set)  # `coord.request_stop(e)` -> `raise`
    while_tests: dict[int, cst.BaseExpression] = field(default_factory=dict)  # While (id) -> new test


class Scaffolding:
    """``survey``: the pipeline planner's walk of ``module``: its calls with their qualified
    names (``calls``), its Name nodes (``names``), and each call's block and statement
    (``of_call``)."""

    def __init__(self, survey, module: cst.Module) -> None:
        self.survey = survey
        self.module = module

    def plan(self) -> ScaffoldPlan | None:
        plan = ScaffoldPlan()
        starters = [c for c, q in self.survey.calls if q == START_QUEUE_RUNNERS]
        coordinators = [c for c, q in self.survey.calls if q == COORDINATOR]
        if not starters and not coordinators:
            return None
        thread_names: set[str] = set()
        coord_names: set[str] = set()
        for call in starters + coordinators:
            body, index = self.survey.of_call.get(id(call), ((), -1))
            if index < 0:
                raise Blocked("the queue-runner call is not in a statement block")
            statement = body[index]
            small = single_small(statement)
            assigned = assignment(statement)
            is_coordinator = any(call is c for c in coordinators)
            if isinstance(small, cst.Expr) and small.value is call:
                pass
            elif assigned is not None and assigned[1] is call and isinstance(assigned[0], cst.Name):
                (coord_names if is_coordinator else thread_names).add(assigned[0].value)
            elif is_coordinator and self._inside_starter(statement, starters):
                pass
            else:
                raise Blocked("put `start_queue_runners(...)` and `Coordinator()` on lines of their own")
            plan.remove.add(id(statement))
        self._uses(plan, coord_names, thread_names)
        return plan

    def _inside_starter(self, statement, starters) -> bool:
        small = single_small(statement)
        value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        return any(value is s for s in starters)

    def _uses(self, plan: ScaffoldPlan, coords: set[str], threads: set[str]) -> None:
        """Every other use of the coordinator and the thread list must be scaffolding too."""
        module = self.module
        allowed: set[int] = set()  # Name nodes accounted for
        scaffolding = self

        class Uses(cst.CSTVisitor):
            def __init__(self) -> None:
                self.except_names: list[str | None] = []

            def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
                name = node.name.name.value if node.name is not None and isinstance(node.name.name, cst.Name) else None
                self.except_names.append(name)

            def leave_ExceptHandler(self, node: cst.ExceptHandler) -> None:
                self.except_names.pop()

            def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
                if id(node) in plan.remove:
                    allowed.update(id(n) for n in find(node, cst.Name))
                    return
                small = single_small(node)
                if not isinstance(small, cst.Expr) or not isinstance(small.value, cst.Call):
                    return
                func = small.value.func
                if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in coords):
                    return
                args = small.value.args
                if func.attr.value == "join" and all(names_used(a.value) <= threads | coords for a in args):
                    plan.remove.add(id(node))
                elif func.attr.value == "request_stop" and not args:
                    plan.remove.add(id(node))
                elif func.attr.value == "request_stop" and len(args) == 1 and isinstance(args[0].value, cst.Name) \
                        and self.except_names and args[0].value.value == self.except_names[-1]:
                    plan.reraise.add(id(node))  # coord.join(threads) would have re-raised it
                else:
                    return
                allowed.update(id(n) for n in find(node, cst.Name))

            def visit_If(self, node: cst.If) -> None:
                # `if coord.should_stop(): break`
                if node.orelse is None and scaffolding._should_stop(node.test, coords) and len(node.body.body) == 1:
                    only = single_small(node.body.body[0])
                    if isinstance(only, cst.Break):
                        plan.remove.add(id(node))
                        allowed.update(id(n) for n in find(node.test, cst.Name))

            def visit_While(self, node: cst.While) -> None:
                test = scaffolding._without_should_stop(node.test, coords)
                if test is not node.test:
                    plan.while_tests[id(node)] = test
                    allowed.update(id(n) for n in find(node.test, cst.Name))

        visit_read_only(module, Uses())
        for name in self.survey.names:
            if name.value in coords | threads and id(name) not in allowed:
                if name.value in coords:
                    raise Blocked(f"`{name.value}` (the Coordinator) is also used for something else than the queue runners")
                raise Blocked(f"the queue-runner threads `{name.value}` are used for something else than `join`")

    @staticmethod
    def _should_stop(node: cst.BaseExpression, coords: set[str]) -> bool:
        return (
            isinstance(node, cst.Call) and not node.args and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "should_stop" and isinstance(node.func.value, cst.Name)
            and node.func.value.value in coords
        )

    def _not_should_stop(self, node: cst.BaseExpression, coords: set[str]) -> bool:
        return isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not) and self._should_stop(node.expression, coords)

    def _without_should_stop(self, test: cst.BaseExpression, coords: set[str]) -> cst.BaseExpression:
        """`not coord.should_stop()` -> True; `not coord.should_stop() and x` -> x."""
        if self._not_should_stop(test, coords):
            return cst.Name("True")
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            if self._not_should_stop(test.left, coords):
                return test.right
            if self._not_should_stop(test.right, coords):
                return test.left
        return test
