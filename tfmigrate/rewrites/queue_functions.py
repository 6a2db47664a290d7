"""The queue pipelines public TF1 code splits across functions (``tfmigrate.rewrites.pipelines``):
a reader function given the queue, a batching helper given the examples, a function that makes
its own queue and returns its examples, a reader function that batches too. Each such function
is rewritten once for all its callers, or not at all (``AcrossFunctions._settle``).

``AcrossFunctions`` is the part of the pipeline planner that plans them; it uses the planner's
steps for one block (``_source``, ``_replacement``, ``_producer``, ``_read``, ``_free``, ...).
"""

from __future__ import annotations


import libcst as cst

from tfmigrate.cst.callargs import argument, short_name
from tfmigrate.cst.traversal import (
    find, fresh_name, module_parents, name_reads, names_used, scope_bindings, single_small,
)
from tfmigrate.rewrites.queue_syntax import (
    BATCH_PARAMS, STRING_PRODUCER, Blocked, assigned_names, assignment, batched_tensors, called_name,
    flat_target_names, handed_call, plain_tensor, portable_settings, written_out,
)
from tfmigrate.rewrites.queue_parts import Batch, Definition, Pipeline, ProducerArgs, Read, Source, own_attribute, parse_statements


class AcrossFunctions:
    """The cross-function half of ``pipelines._Planner`` (see the module's docstring)."""

    def _batching_helper(self, pipeline: Pipeline, batch: Batch) -> bool:
        """A batch of a helper function's parameters (cifar10's `_generate_image_and_label_batch(image,
        label, ...)`, which batches with `shuffle_batch` or `batch`): the helper is given the
        dataset of examples instead (as the parameter that took the first example; the others
        go) and batches it; each of its callers makes that dataset from its queue and passes it
        (the pipelines of ``_handed_over``, planned once per call). The helper and all its callers
        are rewritten together or not at all (``_settle``). False where the batched tensors are
        not the helper's parameters."""
        helper = self._function_of(batch.statement)
        if helper is None or not batch.as_tuple:
            return False
        params = self._parameters(helper)
        by_name = {q.name.value: q for q in params}
        if not all(isinstance(t, cst.Name) and t.value in by_name for t in batch.tensors):
            return False
        name = helper.name.value
        pipeline.groups.add(name)
        batched = []  # the tensors of every batching call in the helper (`if shuffle: ... else: ...`)
        for other, qualified in self.calls.calls:
            if qualified in BATCH_PARAMS and self._function_of(other) is helper:
                tensors, _ = batched_tensors(argument(other, BATCH_PARAMS[qualified], "tensors"))
                if [self.code(t) for t in tensors] != batch.returned:
                    raise Blocked(f"`{name}` batches different examples in its batching calls")
                batched += tensors
        if len(set(batch.returned)) != len(batch.returned) or any(
                n.value in batch.returned and not any(n is t for t in batched) for n in name_reads(helper.body, keywords=False)):
            raise Blocked(f"`{name}` uses the examples it batches for something else too")
        if id(helper) not in self._helper_names:
            self._helper_names[id(helper)] = self._free("examples", helper.body)
        examples = self._helper_names[id(helper)]
        helper_source = Source(examples, list(batch.returned), [], [], set(batch.returned), set())
        pipeline.replaced = {id(batch.statement): self._replacement(batch, helper_source, [], name="batches")}
        pipeline.renamed = {id(by_name[batch.returned[0]]): examples}
        pipeline.dropped = {id(by_name[t]) for t in batch.returned[1:]}
        for call in self._calls_of(helper):
            if id(call) not in self._handed:
                self._handed[id(call)] = self._handed_over(call, helper, batch, [by_name[t] for t in batch.returned])
        return True

    def _handed_over(self, call: cst.Call, helper: cst.FunctionDef, batch: Batch, taken: list[cst.Param]) -> Pipeline:
        """The pipeline of one call of a batching helper: the examples it passes (``taken``, the
        parameters the helper batches), made from a queue in the caller's block, become a
        dataset passed in their place."""
        name = helper.name.value
        pipeline = Pipeline(batch_call=call, groups={name}, covers={id(called_name(call))})
        try:
            caller_body, index = self.blocks.of_call[id(call)]
            arguments = [self._bound_argument(call, self._parameters(helper), param, name) for param in taken]
            producer = self._producer(caller_body, index)
            if producer is None:
                raise Blocked(f"the examples `{name}` batches are not produced by its caller from a queue")
            p, producer_call, producer_name = producer
            pipeline.producer_call = producer_call
            statement = caller_body[index]
            threads = batch.threads if isinstance(batch.threads, cst.Integer) else None  # a helper's own setting stays there
            handed = Batch(call, batch.qualified, tuple(q.name.value for q in self._parameters(helper)), None, caller_body,
                            index, statement, assignment(statement)[0] if assignment(statement) else None,
                            [a.value for a in arguments], [self.code(a.value) for a in arguments], True, False, threads)
            source = self._source(caller_body, p, index, producer_call, producer_name)
            parse = parse_statements(handed, source, p)

            def hand_on(dataset: str) -> cst.BaseStatement:
                return statement.deep_replace(call, handed_call(call, arguments, dataset))

            pipeline.replaced = {id(statement): self._replacement(handed, source, [source.rewritten.get(id(s), s) for s in parse], hand_on)}
            pipeline.removed = list(source.removed) + parse
            pipeline.renamed = source.renamed
            pipeline.groups |= source.groups
            pipeline.covers |= source.covers
        except Blocked as blocked:
            pipeline.blocker = str(blocked)
        return pipeline

    def _parameters(self, function: cst.FunctionDef) -> list[cst.Param]:
        """A function's plain parameters, less a method's `self` (or a class method's `cls`)."""
        bound = any(function is d.function and d.bound for d in self._definitions())
        return list(function.params.params)[1 if bound else 0:]

    def _calls_of(self, function: cst.FunctionDef) -> list[cst.Call]:
        """The calls of a module function or method in the module (see ``_callee``)."""
        return [c for c in find(self.module, cst.Call) if id(c) in self.blocks.of_call and self._callee(c) is function]

    def _callee(self, call: cst.Call) -> cst.FunctionDef | None:
        """The module function (`f(...)`) or method (`self.f(...)`, `cls.f(...)`, `Class.f(...)`)
        ``call`` calls, where one definition answers."""
        func = call.func
        if isinstance(func, cst.Name):
            found = [d for d in self._definitions() if d.owner is None and d.function.name.value == func.value]
        elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name):
            owner = func.value.value
            found = [d for d in self._definitions() if d.owner is not None and d.function.name.value == func.attr.value
                     and owner in ("self", "cls", d.owner)]
        else:
            return None
        return found[0].function if len(found) == 1 else None

    def _settle(self, pipelines: list[Pipeline]) -> None:
        """A reader function or batching helper several pipelines share is rewritten for all of
        them or for none: every use of it must be a call one of them rewrites."""
        groups = sorted({group for p in pipelines for group in p.groups})
        changed = True
        while changed:
            changed = False
            for group in groups:
                members = [p for p in pipelines if group in p.groups]
                reason = next((p.blocker for p in members if p.blocker), None)
                if reason is not None:
                    shared = group if " " in group else f"`{group}`"
                    reason = f"{shared} is shared with a queue pipeline that is not rewritten ({reason})"
                elif self._references(group) - set().union(*(p.covers for p in members)):
                    reason = f"`{group}` is also used where no queue pipeline is rewritten"
                for member in members:
                    if reason is not None and member.blocker is None:
                        member.blocker, changed = reason, True

    def _references(self, name: str) -> set[int]:
        """The Name nodes that use a module function or method ``name`` (not its definition)."""
        if " " in name:  # a group that is no function (the batching calls of one `if`)
            return set()
        definitions = {id(d.function.name) for d in self._definitions()}
        return {id(n) for n in self.calls.names if n.value == name and id(n) not in definitions}

    def _function_of(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        """The module function or method ``node`` is in (directly: not in a nested function)."""
        if isinstance(node, cst.Call) and id(node) in self.blocks.of_call:  # a call: the statement it is in
            body, index = self.blocks.of_call[id(node)]
            node = body[index]
        function = self._scope_of(node)
        return function if any(function is d.function for d in self._definitions()) else None

    @staticmethod
    def _bound_argument(call: cst.Call, params: list[cst.Param], param: cst.Param, name: str) -> cst.Arg:
        """The argument of ``call`` that ``param`` receives."""
        if any(a.star for a in call.args):
            raise Blocked(f"`{name}` is called with `*args` or `**kwargs`")
        arg = _arguments_by_parameter(call, params).get(param.name.value)
        if arg is not None and (arg.keyword is not None or plain_tensor(arg.value)):
            return arg
        raise Blocked(f"the example `{param.name.value}` that `{name}` batches is not passed as a name")

    def _examples_function(self, pipeline: Pipeline, batch: Batch) -> bool:
        """A batch of the examples a function of the module returns (the TFRecord tutorials'
        `img, label = read_and_decode("train.tfrecords")`, which makes its own filename queue, reads
        and decodes one example): the function returns the dataset of its examples instead, and
        the caller batches that dataset. False where the batched tensors do not come from such a
        call in the block."""
        found = self._examples_call(batch)
        if found is None:
            return False
        index, call, function = found
        name = function.name.value
        returned, returned_code, as_tuple = self._examples_plan(function)  # the function's own rewrite, planned once
        statement = batch.body[index]
        target = assignment(statement)[0]  # type: ignore[index]
        names = flat_target_names(target) or []
        if len(names) != len(returned_code) or isinstance(target, cst.Name) == as_tuple:
            raise Blocked(f"`{name}`'s examples are not unpacked as it returns them")
        examples = self._free("examples", statement)
        source = Source(examples, names, [], [], set(names), set())
        parse = parse_statements(batch, source, index)
        given = statement.with_changes(body=[single_small(statement).with_changes(targets=[cst.AssignTarget(cst.Name(examples))])])
        pipeline.producer_call = returned.producer_call
        pipeline.removed = returned.removed + parse
        pipeline.replaced = {**returned.replaced, id(statement): [given], id(batch.statement): self._replacement(batch, source, parse)}
        pipeline.renamed = returned.renamed
        pipeline.groups |= {name} | returned.groups
        pipeline.covers = {id(called_name(call))} | returned.covers
        return True

    def _examples_attributes(self, pipeline: Pipeline, batch: Batch) -> bool:
        """A batch of examples another method of the class made from its queue and kept on the
        object (DeepLab's `ImageReader`: `__init__` sets `self.image, self.label` from a slice
        producer, `dequeue(n)` batches them): that method keeps the dataset of the examples on the
        object instead, and this one batches it. False where the batched tensors are not such
        fields."""
        fields = [self.code(t) for t in batch.tensors]
        if not batch.tensors or not all(own_attribute(t) for t in batch.tensors):
            return False
        found = self._fields_set(batch, fields)
        if found is None:
            return False
        function, body, index = found
        name = function.name.value
        statement = body[index]
        locals_ = [self._free(f.split(".", 1)[1], statement) for f in fields]
        local_set = single_small(statement).with_changes(targets=[cst.AssignTarget(  # type: ignore[union-attr]
            cst.parse_expression(", ".join(locals_)) if len(locals_) > 1 else cst.Name(locals_[0]))])
        local_set = statement.with_changes(body=[local_set])
        hand_off = cst.parse_statement(f"return {', '.join(locals_)}\n")
        virtual = (*body[:index], local_set, hand_off, *body[index + 1:])
        producer = self._producer(virtual, index + 1)
        if producer is None:
            raise Blocked(f"`{', '.join(fields)}`, which `{name}` sets, are not made from a queue there")
        p, producer_call, qualified = producer
        pipeline.producer_call = producer_call
        handed = Batch(cst.Call(cst.Name("return")), "", (), None, virtual, index + 1, hand_off, None,
                       [cst.Name(n) for n in locals_], locals_, batch.as_tuple, False, None)
        source = self._source(virtual, p, index + 1, producer_call, qualified)
        parse = parse_statements(handed, source, p)
        kept = self._free_field("examples")
        made = self._replacement(handed, source, [source.rewritten.get(id(s), s) for s in parse],
                                 lambda dataset: cst.parse_statement(f"self.{kept} = {dataset}\n"))
        batches = Source(f"self.{kept}", list(batch.returned), [], [], set(), set())
        pipeline.removed = [s for s in list(source.removed) + parse if s is not local_set]
        pipeline.replaced = {id(statement): made, id(batch.statement): self._replacement(batch, batches, [], name="batches")}
        pipeline.renamed, pipeline.groups, pipeline.covers = source.renamed, pipeline.groups | source.groups, source.covers
        return True

    def _fields_set(self, batch: Batch, fields: list[str]):
        """Where another method of the batching method's class sets the batched ``fields``, once,
        in one statement (and nothing else reads them, and the batching method is called once):
        that method, its statements as they run, and the statement's position; else None."""
        method = self._function_of(batch.statement)
        owner = next((d.owner for d in self._definitions() if d.function is method), None)
        if method is None or owner is None:
            return None
        uses = [a for a in find(self.module, cst.Attribute) if self.code(a) in fields]
        if len(uses) != 2 * len(fields) or sum(1 for n in self.calls.names if n.value == method.name.value) != 2:
            raise Blocked(f"`{', '.join(fields)}` are read elsewhere too, or `{method.name.value}` is called more than once "
                          "(each call batched the same examples' queue)")
        for definition in self._definitions():
            if definition.owner != owner or definition.function is method:
                continue
            body = self.blocks.flat(definition.function.body.body)
            for index, statement in enumerate(body):
                assigned = assignment(statement)
                targets = assigned[0] if assigned is not None else None
                elements = [e.value for e in targets.elements] if isinstance(targets, (cst.Tuple, cst.List)) else [targets]
                if targets is not None and [self.code(e) for e in elements if e is not None] == fields:
                    return definition.function, body, index
        return None

    def _free_field(self, name: str) -> str:
        """``name`` (or ``name_2``, ...) for a new field on the object: one the module does not use."""
        return fresh_name(None, name, {a.attr.value for a in find(self.module, cst.Attribute)})

    def _examples_call(self, batch: Batch) -> tuple[int, cst.Call, cst.FunctionDef] | None:
        """The statement before the batch that binds the batched tensors to what a module
        function returns: its index, the call and the function."""
        needed = set(batch.returned_names)  # followed back through the statements that compute them
        for index in range(batch.index - 1, -1, -1):
            statement = batch.body[index]
            if not assigned_names(statement) & needed:
                continue
            assigned = assignment(statement)
            call = assigned[1] if assigned is not None else None
            function = self._callee(call) if isinstance(call, cst.Call) else None
            if function is not None:
                return index, call, function  # type: ignore[return-value]
            needed |= names_used(statement)
        return None

    def _examples_plan(self, function: cst.FunctionDef) -> tuple[Pipeline, list[str], bool]:
        """How a function that makes its examples from its own queue and returns them returns the
        dataset of those examples instead: its edits (as a Pipeline), what it returned and whether
        as a tuple. Blocked where it cannot."""
        if id(function) not in self._examples_plans:
            try:
                self._examples_plans[id(function)] = self._plan_examples_function(function)
            except Blocked as blocked:
                self._examples_plans[id(function)] = blocked
        plan = self._examples_plans[id(function)]
        if isinstance(plan, Blocked):
            raise plan
        return plan

    def _plan_examples_function(self, function: cst.FunctionDef) -> tuple[Pipeline, list[str], bool]:
        name = function.name.value
        returns = [r for r in find(function.body, cst.Return) if self._function_of(r) is function]
        place = self.blocks.place(module_parents(self.rule.context).get(id(returns[0]))) if len(returns) == 1 else None
        if place is None:
            raise Blocked(f"`{name}` does not end with one `return` of its examples")
        body, index = place
        value = returns[0].value
        tensors, as_tuple = batched_tensors(value.with_changes(lpar=[], rpar=[]) if isinstance(value, cst.Tuple) else value)
        producer = self._producer(body, index)
        if producer is None or index != len(body) - 1:
            raise Blocked(f"`{name}` returns examples it does not make from a queue of its own")
        p, producer_call, producer_name = producer
        handed = Batch(cst.Call(cst.Name("return")), "", (), None, body, index, body[index], None, tensors,
                        [self.code(t) for t in tensors], as_tuple, False, None)
        source = self._source(body, p, index, producer_call, producer_name)
        parse = parse_statements(handed, source, p)
        plan = Pipeline(batch_call=producer_call, producer_call=producer_call)
        statement = body[index]
        plan.replaced = {id(statement): self._replacement(
            handed, source, [source.rewritten.get(id(s), s) for s in parse],
            lambda dataset: cst.parse_statement(f"return {dataset}\n").with_changes(leading_lines=statement.leading_lines))}
        plan.removed = list(source.removed) + parse
        plan.renamed, plan.groups, plan.covers = source.renamed, source.groups, source.covers
        return plan, handed.returned, as_tuple

    def _queue_parameter(self, pipeline: Pipeline, batch: Batch) -> bool:
        """A reader function that batches too (`read_and_decode(filename_queue, batch_size)`
        makes the reader, reads the queue it is given, decodes and batches): its callers make the
        dataset of the queue's records and pass it instead (``_records_handed``), and the function
        maps and batches it. False where the function reads no queue parameter."""
        function = self._function_of(batch.statement)
        found = None
        for param in self._parameters(function) if function is not None else []:
            read = self._read(batch.body, -1, batch.index, param.name.value)
            if read is not None:
                found = param, read
                break
        if found is None:
            return False
        param, read = found
        self._check_key_unused(read.key, batch.body[read.index + 1:])
        name = function.name.value  # type: ignore[union-attr]
        pipeline.groups.add(name)
        removed = [batch.body[read.index]]
        reader_call = self._portable_reader(function, batch.body, read, removed)  # type: ignore[arg-type]
        reader = self._reader_dataset(reader_call)
        if param.name.value in set().union(*(names_used(s) for s in batch.body if s not in removed)):
            raise Blocked(f"`{name}` uses the filename queue otherwise than by reading it once")
        records = self._free("records", function.body)  # type: ignore[union-attr]
        consumed = {read.reader_name} if read.reader_name else set()
        source = Source(records, [read.value_name], [], removed, {read.value_name}, consumed)
        parse = parse_statements(batch, source, read.index)
        pipeline.replaced = {id(batch.statement): self._replacement(batch, source, parse)}
        pipeline.removed = removed + parse
        pipeline.renamed = {id(param): records}
        for call in self._calls_of(function):  # type: ignore[arg-type]
            if id(call) not in self._handed:
                self._handed[id(call)] = self._records_handed(call, function, param, reader)  # type: ignore[arg-type]
        return True

    def _records_handed(self, call: cst.Call, function: cst.FunctionDef, param: cst.Param, reader: tuple[str, str, str]) -> Pipeline:
        """The pipeline of one call of a reader function that batches: the filename queue the
        caller makes and passes becomes the dataset of its files' records (``reader``: the
        dataset class, its arguments and skip)."""
        name = function.name.value
        pipeline = Pipeline(batch_call=call, groups={name}, covers={id(called_name(call))})
        try:
            argument_node = self._bound_argument(call, self._parameters(function), param, name)
            body, index = self.blocks.of_call[id(call)]
            queue = argument_node.value
            producer = self._producer(body, index)
            if producer is None or producer[2] != STRING_PRODUCER or not isinstance(queue, cst.Name):
                raise Blocked(f"the filename queue `{name}` reads is not made by its caller")
            p, producer_call, qualified = producer
            pipeline.producer_call = producer_call
            args = self._producer_args(body[p], producer_call, qualified)
            if self.code(args.target) != queue.value or sum(queue.value in names_used(s) for s in body) != 2:
                raise Blocked(f"the filename queue `{name}` reads is used otherwise too")
            source_text, chain = self._files_chain(args, *reader)
            records = self._free("records", body[index])
            lines = "\n".join(f"    {piece}" for piece in [source_text, *chain])
            made = cst.parse_statement(f"{records} = (\n{lines}\n)\n").with_changes(leading_lines=body[p].leading_lines)
            pipeline.replaced = {id(body[p]): [made], id(body[index]): [body[index].deep_replace(queue, cst.Name(records))]}
        except Blocked as blocked:
            pipeline.blocker = str(blocked)
        return pipeline

    def _portable_reader(self, function: cst.FunctionDef, body, read: Read, removed: list[cst.BaseStatement]) -> cst.Call:
        """The reader a function makes, its arguments written out so that a caller can make the
        same dataset (``portable_settings``); its statement is added to ``removed``."""
        name = function.name.value
        reader_call = self._reader_call(body, read, removed)
        local = {q.name.value for q in function.params.params} | (scope_bindings(function) - {name})
        reader_call = written_out(reader_call, portable_settings(body, list(body).index(removed[-1]), self.code, local))
        if names_used(reader_call, keywords=False) & local:
            raise Blocked(f"the reader's arguments are computed inside `{name}`; the dataset that replaces it is made by the caller")
        return reader_call

    def _reader_function_source(self, body, p: int, b: int, producer: ProducerArgs, removed: list[cst.BaseStatement]) -> Source:
        """The filename queue passed to a reader function of this module, which makes the reader,
        reads one record and decodes it (the "reading data" guide's `read_and_decode(filename_queue)`,
        cifar10's `read_cifar10`): the function now decodes the record it is given, and its call
        runs in the map function, given the dataset's record."""
        queue = producer.target.value  # type: ignore[attr-defined]
        users = [index for index in range(p + 1, b) if queue in names_used(body[index])]
        if len(users) != 1 or not isinstance(body[users[0]], cst.SimpleStatementLine):
            raise Blocked("no `reader.read(queue)` of the filename queue in the same block, nor one call of a reader function given the queue")
        statement = body[users[0]]
        call, argument_node, function, parameter = self._reader_function(statement, queue)
        name = function.name.value
        fbody = self.blocks.flat(function.body.body)
        read = self._read(fbody, -1, len(fbody), parameter.name.value)
        if read is None:
            raise Blocked(f"`{name}` is given the filename queue but does not read it with `reader.read(...)` in its body")
        self._check_key_unused(read.key, fbody[read.index + 1:])
        inner_removed = [fbody[read.index]]
        reader_call = self._portable_reader(function, fbody, read, inner_removed)
        caller = self._function_of(statement)
        if caller is not None and names_used(reader_call, keywords=False) & scope_bindings(caller):
            raise Blocked(f"the reader's arguments name what `{caller.name.value}` binds to something else")
        rest = [s for s in fbody if s not in inner_removed]
        earlier = set().union(*(names_used(s) for s in fbody[:read.index]))
        if parameter.name.value in set().union(*(names_used(s) for s in rest)) or read.value_name in earlier | {
                q.name.value for q in function.params.params}:
            raise Blocked(f"`{name}` uses the filename queue (or the record's name) otherwise than by reading it once")
        dataset_class, extra, skip = self._reader_dataset(reader_call)
        source_text, chain = self._files_chain(producer, dataset_class, extra, skip)
        block_names = set().union(*(names_used(s) for s in body))
        record = read.value_name if read.value_name not in block_names else self._free("record", statement)
        rewritten = {id(statement): statement.deep_replace(argument_node.value, cst.Name(record))}
        return Source(source_text, [record], chain, removed + inner_removed, {queue, record}, set(), rewritten=rewritten,
                       renamed={id(parameter): read.value_name}, groups={name}, covers={id(called_name(call))})

    def _reader_function(self, statement: cst.BaseStatement, queue: str) -> tuple[cst.Call, cst.Arg, cst.FunctionDef, cst.Param]:
        """In ``statement``, the one call given the queue, the argument that passes it, the
        module's function (or method, called on `self`) it calls, and the parameter that receives it."""
        calls = [c for c in find(statement, cst.Call) if any(isinstance(a.value, cst.Name) and a.value.value == queue for a in c.args)]
        if len(calls) != 1 or sum(1 for n in find(statement, cst.Name) if n.value == queue) != 1:
            raise Blocked("the filename queue is used otherwise than by passing it once to a reader function")
        call = calls[0]
        (argument_node,) = [a for a in call.args if isinstance(a.value, cst.Name) and a.value.value == queue]
        function = self._callee(call)
        if function is None:
            raise Blocked("the filename queue is passed to a function that is not this module's")
        return call, argument_node, function, self._parameter_of(call, function, argument_node)

    def _parameter_of(self, call: cst.Call, function: cst.FunctionDef, argument_node: cst.Arg) -> cst.Param:
        """The parameter of ``function`` that ``argument_node`` of ``call`` binds."""
        name = function.name.value
        params = self._parameters(function)
        if function.params.star_arg not in (None, cst.MaybeSentinel.DEFAULT) or function.params.star_kwarg is not None or function.params.kwonly_params:
            raise Blocked(f"`{name}` takes `*args`, `**kwargs` or keyword-only parameters")
        bound = {} if any(a.star for a in call.args) else _arguments_by_parameter(call, params)
        chosen = [q for q in params if bound.get(q.name.value) is argument_node]
        if not chosen:
            raise Blocked(f"which parameter of `{name}` receives the filename queue is not plain")
        return chosen[0]

    def _definitions(self) -> list[Definition]:
        """The module's functions and its classes' methods."""
        if self._defined is None:
            self._defined = []
            for statement in self.module.body:
                if isinstance(statement, cst.FunctionDef):
                    self._defined.append(Definition(statement, None, False))
                elif isinstance(statement, cst.ClassDef):
                    for member in statement.body.body:
                        if isinstance(member, cst.FunctionDef):
                            decorators = {short_name(d.decorator) for d in member.decorators}
                            bound = "staticmethod" not in decorators
                            self._defined.append(Definition(member, statement.name.value, bound))
        return self._defined


def _arguments_by_parameter(call: cst.Call, params: list[cst.Param]) -> dict[str, cst.Arg]:
    """The argument of ``call`` (without `*args`/`**kwargs`) each of ``params`` receives, by name."""
    bound = {param.name.value: arg for param, arg in zip(params, [a for a in call.args if a.keyword is None])}
    bound.update({arg.keyword.value: arg for arg in call.args if arg.keyword is not None})
    return bound
