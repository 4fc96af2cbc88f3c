"""Public extension point: per-example rules of the fast clipping backend.

A rule tells the fast backend how one use of a trainable variable by one op type gives each
example's gradient, so that the backend can compute per-example squared norms (ghost norms) and
the clipped sum (book-keeping) without per-example jacobians. The contract is in
``keras_dpsgd.backends.tensorflow.handlers`` (and in CONTRIBUTING.md, "A new per-example rule"):

    @register_rule("MyOp")
    def my_op(op, index, w, var, clean, static_batch) -> Site | None: ...

A rule returns None for anything it does not recognize; the variable then gets exact per-example
jacobians (the reference path). Ops upstream of the loss must also be proven to keep the examples
apart (``keras_dpsgd.backends.tensorflow._rows``, an allowlist) for any rule to be used.
"""

from keras_dpsgd.backends.tensorflow.handlers import Site, register_rule, rule_for
from keras_dpsgd.backends.tensorflow.uses import DenseUse, IndexUse, OuterUse, PiecesUse

__all__ = ["DenseUse", "IndexUse", "OuterUse", "PiecesUse", "Site", "register_rule", "rule_for"]
