"""The op registry: for each torch function, how its dimensions line up.

Each entry maps a call target (``'torch.nn.functional.linear'``, ``'Tensor.view'``, ...) to an
``OpSpec``: a name and a function that reads the recorded call (its arguments and shapes) and returns
the call's ``OpAnnotation``. Most ops use a fixed string (``'* k+, n k+ -> * n'``); shape-dependent
ones (reshape, indexing, broadcasting arithmetic) compute it. The annotators themselves live in
``shape_rules`` (ops that move or combine elements) and ``layer_rules`` (the layers' ops); this
module fills the table from call targets to them (``op_specs``).

Ops missing here still trace: they become *opaque* nodes that run replicated, with a warning.
``register_op`` adds your own function as a single op:

>>> @register_op('b d+, d+ e -> b e')                        # doctest: +SKIP
... def my_matmul(x, w):
...     return x @ w
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.graph import IRNode
from nbscaler.ir.layer_rules import (WINDOW_TARGET, attention, batch_norm, conv, embedding, linear, loss, matmul,
                                     normalization)
from nbscaler.ir.op_specs import register, spec_of
from nbscaler.ir.shape_rules import (along_dim, concat, constructor, elementwise, fixed, indexing,
                                     permutation, repeat_interleave, reduction, reshape, split_like, triangle,
                                     widen)

USER_OPS: Dict[str, Callable] = {}          # target -> user function registered with register_op


# ------------------------------------------------------------------------------------------------
# Call targets: one readable name per torch callable
# ------------------------------------------------------------------------------------------------
_NAMESPACES = ((F, "torch.nn.functional"), (torch, "torch"), (torch.special, "torch.special"),
               (torch.linalg, "torch.linalg"), (torch.fft, "torch.fft"))


def target_of(func: Callable) -> str:
    """The readable dotted name of a callable that the tracer saw.

    Tensor methods and properties become ``'Tensor.<name>'``; free functions the shortest public
    path (``torch._C._nn.linear`` is ``'torch.nn.functional.linear'``).
    """
    name = getattr(func, "__name__", "")
    if name == "__get__" and hasattr(func, "__self__"):       # a property such as Tensor.T
        return "Tensor." + func.__self__.__name__
    user_target = getattr(func, "_nbscaler_target", None)      # a function made an op by register_op
    if user_target is not None:
        return user_target
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    for ns, prefix in _NAMESPACES:
        if getattr(ns, name, None) is func:
            return f"{prefix}.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{qual or name}"


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------
def _both(names: str, prefix: str = "torch") -> str:
    """'add mul' -> 'torch.add Tensor.add torch.mul Tensor.mul'."""
    return " ".join(f"{prefix}.{n} Tensor.{n}" for n in names.split())


_UNARY = ("relu gelu silu tanh sigmoid exp log neg abs sqrt rsqrt sin cos sign square reciprocal "
          "float half bfloat16 double to type_as contiguous clone detach clamp clip pow erf "
          "masked_fill logical_not isnan isinf nan_to_num")
_BINARY = ("add sub mul div true_divide floor_divide remainder maximum minimum eq ne lt le gt ge "
           "logical_and logical_or where")
_INPLACE = "add_ sub_ mul_ div_ masked_fill_ clamp_ copy_ fill_ zero_ pow_ relu_"
_DUNDER = ("__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ "
           "__rtruediv__ __itruediv__ __neg__ __pow__ __rpow__ __eq__ __ne__ __lt__ __le__ __gt__ "
           "__ge__ __and__ __or__ __invert__ __mod__ __floordiv__")
INPLACE_TARGETS = {f"Tensor.{n}" for n in _INPLACE.split()} | {"Tensor.__iadd__", "Tensor.__isub__",
                                                                "Tensor.__imul__", "Tensor.__itruediv__",
                                                                "Tensor.__setitem__"}

register(_both(_UNARY) + " " + _both(_BINARY) + " " + " ".join(f"Tensor.{n}" for n in _INPLACE.split())
          + " " + " ".join(f"Tensor.{n}" for n in _DUNDER.split())
          + " torch.nn.functional.relu torch.nn.functional.gelu torch.nn.functional.silu "
            "torch.nn.functional.tanh torch.nn.functional.sigmoid torch.nn.functional.dropout "
            "torch.nn.functional.leaky_relu torch.nn.functional.mish torch.nn.functional.elu "
            "Tensor.type Tensor.long Tensor.int Tensor.bool torch.ones_like torch.zeros_like "
            "torch.full_like torch.empty_like torch.rand_like torch.randn_like",
          "elementwise", elementwise)
register("torch.nn.functional.linear", "linear", linear)
register(_both("matmul bmm mm") + " Tensor.__matmul__ Tensor.__rmatmul__", "matmul", matmul)
register("torch.nn.functional.conv1d torch.nn.functional.conv2d torch.conv1d torch.conv2d", "conv", conv)
register("torch.nn.functional.embedding", "embedding", embedding)
register("torch.nn.functional.layer_norm torch.nn.functional.rms_norm torch.layer_norm torch.rms_norm",
          "norm", normalization)
register("torch.nn.functional.batch_norm torch.batch_norm", "batch_norm", batch_norm)
register(_both("softmax log_softmax") + " torch.nn.functional.softmax torch.nn.functional.log_softmax",
          "softmax", along_dim(1, "dim"))
register(_both("cumsum cumprod"), "scan", along_dim(1, "dim"))
register(_both("sum nansum"), "sum", reduction("sum"))
register(_both("mean amax amin max min argmax argmin var std norm logsumexp all any prod"),
          "reduce", reduction("other"))
register("torch.nn.functional.cross_entropy torch.nn.functional.nll_loss torch.nn.functional.mse_loss",
          "loss", loss)
register(_both("view reshape flatten unflatten squeeze unsqueeze") + " Tensor.view_as Tensor.reshape_as",
          "reshape", reshape)
# Only view/reshape spell out the shape; the others take axis numbers that a split leaves unchanged.
register("Tensor.view Tensor.reshape torch.reshape", "reshape", reshape, shape_args=True)
register(_both("transpose permute t swapaxes") + " Tensor.T Tensor.mT", "transpose", permutation)
register("Tensor.__getitem__", "getitem", indexing)
register(_both("split chunk unbind") + " Tensor.tensor_split", "split", split_like)
register("torch.cat torch.concat torch.concatenate torch.stack", "concat", concat)
register(_both("repeat_interleave"), "repeat_interleave", repeat_interleave)
register("Tensor.expand", "expand", widen, shape_args=True)
register("Tensor.expand_as", "expand", widen)
register("Tensor.repeat", "repeat", widen)
register(_both("triu tril"), "triangle", triangle)
register("torch.nn.functional.scaled_dot_product_attention " + WINDOW_TARGET, "attention", attention)
register("torch.ones torch.zeros torch.full torch.empty torch.arange torch.linspace torch.eye "
          "torch.tensor torch.as_tensor torch.rand torch.randn torch.randint torch.polar torch.outer",
          "constructor", constructor)


# ------------------------------------------------------------------------------------------------
# User ops
# ------------------------------------------------------------------------------------------------
def register_op(annotation: str, name: Optional[str] = None):
    """Make a function one op of the graph, split according to ``annotation``.

    The decorated function takes part in torch's own ``__torch_function__`` protocol, as the
    functions of ``torch.nn.functional`` do: with a ``TorchFunctionMode`` active (the tracer is
    one) or a tensor subclass that overrides torch functions among its arguments, the call is
    handed to them as one call of the decorated function. The tracer records it as a single node
    instead of looking inside, and code generation calls it by its import path, so it must live in
    an importable module (not a notebook's ``__main__``). The annotation uses the syntax of
    ``OpAnnotation``.

    >>> @register_op('* k+, n k+ -> * n')                       # doctest: +SKIP
    ... def fused_linear(x, w): ...
    """
    def decorate(fn: Callable) -> Callable:
        target = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def op(*args, **kwargs):
            tensors = tuple(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
            if torch.overrides.has_torch_function(tensors) or (
                    not tensors and torch._C._is_torch_function_mode_enabled()):
                return torch.overrides.handle_torch_function(op, tensors, *args, **kwargs)
            return fn(*args, **kwargs)

        op._nbscaler_target = target
        USER_OPS[target] = fn
        register(target, name or fn.__name__, fixed(annotation))
        return op
    return decorate


_warned: set = set()


def annotate(node: IRNode) -> Optional[OpAnnotation]:
    """The node's annotation, or ``None`` (with a one-time warning) when the op is unknown."""
    spec = spec_of(node.target)
    if spec is not None:
        try:
            return spec.annotate(node)
        except Exception as err:       # a shape the annotator does not understand: run it whole
            reason = f"its annotation failed ({err})"
    else:
        reason = "it is not in the op registry"
    if node.target not in _warned:
        _warned.add(node.target)
        warnings.warn(f"nbscaler: '{node.target}' ({node.module_path or 'top level'}) runs replicated on every "
                      f"device because {reason}; add it with nbscaler.register_op to let policies split it.",
                      stacklevel=2)
    return None


# The ops of real model families (GPT-2's addmm, pooling, padding, routing, ...) live in their own module.
# Imported last: where it names a target of the table above (``Tensor.__getitem__``), its entry wins.
from nbscaler.ir import model_ops  # noqa: E402,F401  (registers on import)
