"""Python values read from the input data: specialise on them, and check them on every call.

One trace follows one path through forward's Python control flow. When forward reads a tensor
computed from the input data into Python (``if attention_mask.all():``, ``n = int(lengths.max())``),
the traced graph holds for inputs that give the same value only. Two answers:

- **guard** (the default): keep the traced value and record a *guard* node, an ``IRNode`` whose
  ``op`` is ``'guard'``, whose call is the read (``Tensor.__bool__`` on the mask's ``all``) and whose
  ``outputs`` is the value seen while tracing. Code generation turns it into a check that runs on
  every call and raises ``GuardError`` naming the user's line when an input gives another value;
- **refuse** (``ComputeConfig(guard_data_dependent=False)``): stop tracing with a ``TraceError``.

Values that depend only on shapes and constants need neither: they are the same on every call.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from nbscaler.ir.graph import IRNode

#: Calls that turn tensor values into Python values, and how generated code writes each one.
READS = {"Tensor.item": "{0}.item()", "Tensor.__bool__": "bool({0})", "Tensor.tolist": "{0}.tolist()",
         "Tensor.__int__": "int({0})", "Tensor.__float__": "float({0})", "Tensor.__index__": "{0}.__index__()",
         "Tensor.is_nonzero": "{0}.is_nonzero()", "torch.is_nonzero": "torch.is_nonzero({0})",
         "Tensor.equal": "{0}.equal({1})", "torch.equal": "torch.equal({0}, {1})"}

GUARD_OP = "guard"


def describe_site(module_path: str, source: Optional[Tuple[str, int]]) -> str:
    """Where a call happened, for messages: ``'model.py:42 (in blocks.0.attn)'``."""
    at = f"{os.path.basename(source[0])}:{source[1]}" if source else "forward"
    return f"{at} (in {module_path})" if module_path else at


def read_name(target: str) -> str:
    """``'Tensor.__bool__'`` -> ``'__bool__()'``, ``'torch.equal'`` -> ``'torch.equal()'``."""
    return (target[len("Tensor."):] if target.startswith("Tensor.") else target) + "()"


def refusal(target: str, tensor_name: str, site: str) -> str:
    """The message of the ``TraceError`` raised when guards are off."""
    return (f"{read_name(target)} on '{tensor_name}' at {site} turns a value computed from the input data into a "
            "Python value, so the traced graph would freeze it. Keep it a tensor (e.g. torch.where instead of "
            "`if`), move the decision out of forward, or allow ComputeConfig(guard_data_dependent=True) to "
            "specialise on the traced value with a check on every call.")


def guard_node(name: str, target: str, args: Tuple, kwargs: Dict[str, Any], value: Any,
               module_path: str, source: Optional[Tuple[str, int]]) -> IRNode:
    """A guard: the read ``target(*args, **kwargs)`` must give ``value`` again on every call."""
    return IRNode(name=name, target=target, op=GUARD_OP, args=args, kwargs=kwargs, outputs=value,
                  module_path=module_path, source=source)


def guard_expression(node: IRNode, rendered_args: Tuple[str, ...]) -> str:
    """The read a guard repeats, as source over already-rendered tensor arguments: ``bool(all_3)``."""
    return READS[node.target].format(*rendered_args)


def assumption(node: IRNode, rendered_args: Tuple[str, ...]) -> str:
    """What a guard assumes, in words, for its error message."""
    return f"{guard_expression(node, rendered_args)} == {node.outputs!r}"
