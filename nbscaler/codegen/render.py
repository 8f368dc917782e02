"""Writing traced calls back out as Python source.

``render`` turns a constant argument into source (``slice(1, 3)`` into ``1:3`` inside a subscript,
a dtype into ``torch.float32``), and ``render_call`` a recorded call into the expression a person
would have written: ``x.view(2, 8)``, ``a + b``, ``x[:, -1]``, ``F.softmax(x, dim=-1)``.
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
import re
import types
from typing import Any, Dict, Sequence, Tuple

import torch

from nbscaler.ir.graph import IRNode
from nbscaler.ir.registry import USER_OPS


class CodegenError(RuntimeError):
    """A traced call that cannot be written back as Python; names the call and its source."""


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "true_divide": "/", "__add__": "+",
          "__sub__": "-", "__mul__": "*", "__truediv__": "/", "__matmul__": "@", "__pow__": "**",
          "__mod__": "%", "__floordiv__": "//", "__eq__": "==", "__ne__": "!=", "__lt__": "<",
          "__le__": "<=", "__gt__": ">", "__ge__": ">=", "__and__": "&", "__or__": "|"}
_RINFIX = {"__radd__": "+", "__rsub__": "-", "__rmul__": "*", "__rtruediv__": "/", "__rmatmul__": "@",
           "__rpow__": "**"}
INPLACE_OPERATORS = {"__iadd__": "+=", "__isub__": "-=", "__imul__": "*=", "__itruediv__": "/="}
_UNARY = {"__neg__": "-", "__invert__": "~"}


def attr_name(qualified: str) -> str:
    """'blocks.0.attn.q.weight' -> 'blocks_0_attn_q_weight'."""
    return re.sub(r"\W", "_", qualified)


def group_var(devices: Sequence[int]) -> str:
    return "g" + "_".join(map(str, devices))


class Code(str):
    """Already-rendered source text (a variable name or an expression)."""


def render(value: Any, index: bool = False) -> str:
    """A constant argument as Python source. ``index`` renders slices as ``a:b`` for subscripts."""
    if isinstance(value, Code):
        return str(value)
    if isinstance(value, slice):
        if index:
            parts = ["" if v is None else render(v) for v in (value.start, value.stop, value.step)]
            return ":".join(parts[:2]) + (f":{parts[2]}" if value.step is not None else "")
        return f"slice({render(value.start)}, {render(value.stop)}, {render(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.device):
        return "self.device"
    if isinstance(value, torch.Size):
        value = tuple(value)
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"float('{value}')"
    if isinstance(value, tuple):
        inner = ", ".join(render(v, index) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise CodegenError(f"cannot write the constant {value!r} ({type(value).__name__}) into generated code")


def _is_property(name: str) -> bool:
    return isinstance(getattr(torch.Tensor, name, None), (property, types.GetSetDescriptorType))


def render_call(node: IRNode, args: Tuple, kwargs: Dict[str, Any]) -> str:
    """The call expression for ``node`` over already-rendered arguments."""
    target = node.target
    if target == "Tensor.__getitem__":
        idx = args[1]
        inner = ", ".join(render(i, index=True) for i in idx) if isinstance(idx, tuple) else render(idx, index=True)
        return f"{render(args[0])}[{inner or '()'}]"
    if target.startswith("Tensor."):
        name = target[len("Tensor."):]
        first, rest = render(args[0]), args[1:]
        if not kwargs and len(rest) == 1 and name in _INFIX:
            return f"{first} {_INFIX[name]} {render(rest[0])}"
        if not kwargs and len(rest) == 1 and name in _RINFIX:
            return f"{render(rest[0])} {_RINFIX[name]} {first}"
        if not kwargs and not rest and name in _UNARY:
            return f"{_UNARY[name]}{first}"
        if not rest and not kwargs and _is_property(name):
            return f"{first}.{name}"
        return f"{first}.{name}({_arglist(rest, kwargs)})"
    if target.startswith("torch.nn.functional."):
        fn = "F." + target[len("torch.nn.functional."):]
        kwargs = _without_defaults(target, kwargs)
        while args and args[-1] is None and len(args) > 1:      # trailing optional tensors left out
            args = args[:-1]
    elif target in USER_OPS:
        fn = user_op_alias(target)
    elif is_library_op(target):
        fn = target.rpartition(".")[2]
    else:
        fn = target
    return f"{fn}({_arglist(args, kwargs)})"


def is_library_op(target: str) -> bool:
    """Whether ``target`` is one of nbscaler's own ops (``nbscaler.attention.window.sliding_window_attention``),
    which generated code imports by name (``library_imports``)."""
    return target.startswith("nbscaler.") and target not in USER_OPS


def user_op_alias(target: str) -> str:
    return "_op_" + attr_name(target)


def _without_defaults(target: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Drop keyword arguments that only repeat the function's defaults (torch passes them all)."""
    fn = getattr(torch.nn.functional, target.rsplit(".", 1)[-1], None) if target.startswith("torch.nn.functional.") else None
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):
        params = {}
    return {k: v for k, v in kwargs.items()
            if not (k in params and params[k].default is not inspect.Parameter.empty
                    and type(params[k].default) is type(v) and params[k].default == v)}


def _arglist(args: Sequence, kwargs: Dict[str, Any]) -> str:
    return ", ".join([render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()])


def source_comment(node: IRNode) -> str:
    where = node.module_path or "(top level)"
    if not node.source:
        return f"# {where}"
    path, line = node.source
    code = linecache.getline(path, line).strip()
    return f"# {where}: {code}    ({os.path.basename(path)}:{line})" if code else f"# {where}    ({os.path.basename(path)}:{line})"
