"""The typed operand records of the ops: one module per op family.

Each op of ragged takes its operands as one ``typing.NamedTuple`` record, defined here, below
the kernels, so that the op's definition (``ragged/ops/<family>.py``), its pure-torch
reference, every kernel implementation (``ragged/kernels/<backend>/<family>.py``) and the
layer core (``nn/layer.py``) all read the same fields by name. A record is a tuple: the
``torch.library`` op takes its fields in order (:func:`ragged.opdef.define` derives the op's
schema from the annotations), and building one costs what building a tuple costs.
Adding an operand to an op is one field here (with a default, so callers that do not use it
need not change), its reading in the reference, and its reading in the kernels that support
it (the others decline it through their declared reasons).
"""
