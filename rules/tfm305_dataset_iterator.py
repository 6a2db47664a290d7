from __future__ import annotations

import libcst as cst

from tfmigrate.rule import Edit, FixSafety, Invalid, Rule

#: Dataset method -> the tf.compat.v1 function that replaces it.
ITERATOR_METHODS = {
    "make_one_shot_iterator": "tf.compat.v1.data.make_one_shot_iterator",
    "make_initializable_iterator": "tf.compat.v1.data.make_initializable_iterator",
}


class DatasetIterator(Rule):
    code = "TFM305"
    name = "dataset-iterator"
    summary = "`dataset.make_one_shot_iterator()` / `make_initializable_iterator()` methods are gone in TF2"
    triggers = tuple(ITERATOR_METHODS)
    fix_safety = FixSafety.SAFE

    what_it_finds = """
        The Dataset *methods* `ds.make_one_shot_iterator()` and
        `ds.make_initializable_iterator()`, on any expression (a variable, a chained
        `tf.data.TFRecordDataset(...).map(...).make_one_shot_iterator()`, an attribute).
        The *functions* `tf.compat.v1.data.make_one_shot_iterator(ds)` and
        `tf.compat.v1.data.make_initializable_iterator(ds)` are the replacement and are not
        reported; neither is a function of another imported module called with the dataset as
        its argument (`mylib.make_one_shot_iterator(ds)`).
    """
    why = """
        TF2's `tf.data.Dataset` has no `make_one_shot_iterator` / `make_initializable_iterator`
        methods. They survive, deprecated, only on `tf.compat.v1.data.Dataset` (DatasetV1), so
        the call fails with `AttributeError` as soon as the dataset is a TF2 one: built through
        `tf.data` under TF2 behaviour, returned by `tfds`, or distributed by a strategy.
        The functions in `tf.compat.v1.data` take either kind and keep the same behaviour in
        graph mode. Under `MirroredStrategy` use the initializable form on the distributed
        dataset (`strategy.experimental_distribute_dataset(ds)`): a one-shot iterator is
        refused there.
    """
    example = """
        dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(32)
        iterator = dataset.make_one_shot_iterator()
        images, labels = iterator.get_next()
    """
    use_instead = """
        dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(32)
        iterator = tf.compat.v1.data.make_one_shot_iterator(dataset)
        images, labels = iterator.get_next()
    """
    fix_notes = """
        Safe: `ds.make_one_shot_iterator()` becomes
        `tf.compat.v1.data.make_one_shot_iterator(ds)` and `ds.make_initializable_iterator()`
        becomes `tf.compat.v1.data.make_initializable_iterator(ds)`, keeping any
        `shared_name=` argument; the behaviour is identical in TF1 and in TF2 graph mode.
        The module's own TensorFlow import is used: under `import tensorflow.compat.v1 as tf`
        the call is `tf.data.make_one_shot_iterator(ds)`; with no TensorFlow import,
        `import tensorflow as tf` is added.
        Moving to eager iteration (`for batch in dataset`) is a larger change left to the
        `tf2` target.
    """

    valid = [
        """
        import tensorflow as tf
        iterator = tf.compat.v1.data.make_one_shot_iterator(dataset)
        """,
        """
        import tensorflow.compat.v1 as tf
        iterator = tf.data.make_initializable_iterator(dataset, shared_name="input")
        """,
        """
        import tensorflow as tf
        for images, labels in dataset:
            step(images, labels)
        """,
    ]
    invalid = [
        Invalid(
            """
            import tensorflow as tf
            iterator = dataset.make_one_shot_iterator()
            """,
            line=2,
            fixed="""
            import tensorflow as tf
            iterator = tf.compat.v1.data.make_one_shot_iterator(dataset)
            """,
        ),
        Invalid(
            """
            import tensorflow as tf
            iterator = (
                tf.data.TFRecordDataset(files)
                .map(parse)
                .batch(32)
                .make_initializable_iterator()
            )
            """,
            line=3,
            fixed="""
            import tensorflow as tf
            iterator = (
                tf.compat.v1.data.make_initializable_iterator(
                    tf.data.TFRecordDataset(files)
                    .map(parse)
                    .batch(32),
                )
            )
            """,
        ),
    ]

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if not isinstance(func, cst.Attribute) or func.attr.value not in ITERATOR_METHODS:
            return
        method = func.attr.value
        qualified = self.qualified(func)
        if qualified == f"tensorflow.data.{method}":
            return  # the function form, tf.compat.v1.data.make_one_shot_iterator(ds)
        positional = [a for a in node.args if a.keyword is None]
        if self.qualified(func.value) is not None and positional and not qualified.startswith("tensorflow.data."):
            return  # mylib.make_one_shot_iterator(ds): a module's function, given the dataset
        subject: cst.CSTNode = func.value
        if qualified is not None and qualified.startswith("tensorflow.data.") and positional:
            subject = positional[0].value  # tf.data.Dataset.make_one_shot_iterator(ds)
        receiver = self.context.module.code_for_node(subject).strip()
        if len(receiver) > 30 or "\n" in receiver:
            receiver = "dataset"
        self.report(
            node,
            f"`.{method}()` is a Dataset method removed from TF2's tf.data.Dataset; call "
            f"`{ITERATOR_METHODS[method]}({receiver})` instead",
            edit=self._edit(node, method, subject),
        )

    def _edit(self, node: cst.Call, method: str, subject: cst.CSTNode) -> Edit | None:
        if any(a.star for a in node.args):
            return None
        rest = list(node.args)
        if subject is not node.func.value:  # tf.data.Dataset.make_one_shot_iterator(ds, ...)
            rest = [a for a in rest if a.value is not subject]
        func, imports = self.tf_ref(f"tensorflow.compat.v1.data.{method}")
        first = cst.Arg(value=subject)
        if rest:
            first = first.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        new = node.with_changes(func=func, args=[first, *rest])
        subject_code = self.context.module.code_for_node(subject)
        if "\n" in subject_code and "#" not in subject_code.rsplit("\n", 1)[1]:
            new = self._multiline(node, func, subject_code, rest) or new
        return Edit({node: new}, f"call `tf.compat.v1.data.{method}(...)`", add_imports=imports)

    def _multiline(self, node: cst.Call, func: cst.BaseExpression, subject_code: str, rest: list) -> cst.Call | None:
        """A chained dataset spread over lines stays one step per line, one level deeper."""
        first, *more = subject_code.split("\n")
        # Continuation lines are rendered relative to the enclosing block's indentation.
        base = min(len(line) - len(line.lstrip(" ")) for line in more)
        inner = " " * (base + 4)
        lines = [f"{inner}{first.strip()}"] + [f"    {line}" for line in more]
        lines[-1] += ","
        code = self.context.module.code_for_node
        lines += [f"{inner}{code(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip()}," for arg in rest]
        text = f"{code(func)}(\n" + "\n".join(lines) + f"\n{' ' * base})"
        try:
            call = cst.ensure_type(cst.parse_expression(text), cst.Call)
        except Exception:
            return None
        return call.with_changes(lpar=node.lpar, rpar=node.rpar)
