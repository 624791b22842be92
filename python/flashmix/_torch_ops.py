"""Registers the torch custom ops ``torch.ops.flashmix.*`` that moe.py and mhc.py
define beside their functions. Imported by them only when torch is importable.

The ops are functional (outputs are fresh tensors, inputs are not written;
an op that uses a caller's workspace declares it mutated), with fake
implementations (shape functions), so they trace under torch.compile (one
graph node each, no graph break) and work inside CUDA graphs (the real
implementation allocates from the current stream's pool and launches on the
current stream). Forward only: no autograd formula is registered.

An op's schema is its function's signature, whose defaults are read from the
same place as the flashmix function's (the library's defaults, through the
binding), so no default is stated here or in an op.
"""
import inspect
from typing import Optional, Tuple  # noqa: F401 (re-exported for the areas' op signatures)

import torch
from torch import Tensor  # noqa: F401 (re-exported)


def custom_op(name, *, fake, mutates_args=()):
    """Decorator: registers the function as ``torch.ops.flashmix.<name>`` (its signature, type
    annotations and defaults make the schema) with ``fake`` as its fake implementation.

    ``fake`` is called with every argument by keyword: the dispatcher leaves out arguments that
    equal their default, and they are filled in here from the op's signature, so a fake takes
    what it needs by name (``def fake(x, phi, **_)``) and states no default."""
    def register(fn):
        op = torch.library.custom_op(f"flashmix::{name}", fn, mutates_args=mutates_args)
        signature = inspect.signature(fn)

        def fake_impl(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return fake(**bound.arguments)

        op.register_fake(fake_impl)
        return op
    return register
