"""Record a module's forward pass as an ``IRGraph`` of torch-function calls.

The tracer runs the forward once on the dummy arguments inside a ``TorchFunctionMode``, so every
torch call (``F.linear``, ``x.view``, ``a + b``, ``x[:, :4]``, ``torch.arange``) passes through
``Tracer.__torch_function__`` with concrete tensors. Running the Python code, instead of with
symbolic proxies, means control flow on shapes (``if x.dim() == 4``, ``B, T, C = x.shape``) just
works; the price is that such values are fixed at their traced values.

Calls that read a parameter run on fake tensors: shapes and dtypes only, no arithmetic (see
``nbscaler.trace.values``). Everything else runs for real, so Python may read values made from
shapes and constants freely; values read from the input data become guards (``trace.guards``). A
forward that needs a parameter-dependent value in Python is traced again on real tensors, with a
warning that says why.

For each call it records a node with:

- the tensors it read, found by identity: forward arguments, the module's parameters and buffers,
  constants, or earlier outputs;
- the module it ran in (``blocks.2.attn.q``), kept by module forward hooks;
- the line of *user* code that made the call, found by walking out of torch's own frames.

``self.training`` branches are handled by tracing once per mode (see ``trace_module``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from nbscaler.ir.graph import IRGraph, IRNode, IRTensor
from nbscaler.ir.registry import INPLACE_TARGETS, annotate, spec_of, target_of
from nbscaler.trace.training import watch_training_reads
from nbscaler.trace.stand_ins import stand_ins
from nbscaler.trace.guards import GUARD_OP, READS, describe_site, guard_node, read_name, refusal
from nbscaler.trace.values import NeedsRealValues, Provenance, TracedValues

_TORCH_DIR = os.path.dirname(torch.__file__)
_NBSCALER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLES_DIR = os.path.join(_NBSCALER_DIR, "models")        # user code that ships with nbscaler

# Calls that return tensors but are bookkeeping, not computation.
_IGNORED = {"Tensor.data", "Tensor.grad", "Tensor.requires_grad_", "Tensor.retain_grad", "Tensor.__len__"}


class TraceError(RuntimeError):
    """The module cannot be traced with these arguments; the message says why and what to change.

    ``refused`` is set when the trace stopped on purpose (control flow on input data with guards
    off), as opposed to a forward that failed to run.
    """

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


def _identifier(text: str) -> str:
    name = re.sub(r"\W+", "_", text).strip("_") or "t"
    return name if not name[0].isdigit() else "t_" + name


def _user_frame() -> Optional[Tuple[str, int]]:
    """The innermost frame outside torch and nbscaler: the user's line that caused the call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        machinery = path.startswith(_NBSCALER_DIR) and not path.startswith(_EXAMPLES_DIR)
        if not (path.startswith(_TORCH_DIR) or machinery or path.startswith("<frozen")
                or path.endswith(("contextlib.py", "functools.py"))):
            return path, frame.f_lineno
        frame = frame.f_back
    return None


class Tracer(TorchFunctionMode):
    """Records torch calls into nodes. Use ``trace_module``; this class is the machinery."""

    def __init__(self, root: torch.nn.Module, fake: bool = True, guards: bool = True,
                 meta_device: torch.device = torch.device("cpu")):
        super().__init__()
        self.nodes: List[IRNode] = []
        self.by_id: Dict[int, IRTensor] = {}
        self.keep_alive: List[Any] = []          # ids stay unique only while the objects live
        self.weights: Dict[str, IRTensor] = {}
        self.constants: Dict[str, torch.Tensor] = {}
        self.counts: Dict[str, int] = {}
        self.module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        self.module_stack: List[str] = []
        self.failed_in: Optional[str] = None
        self.values = TracedValues(fake, meta_device)
        self.guards = guards
        for kind, items in (("param", root.named_parameters(remove_duplicate=False)),
                            ("buffer", root.named_buffers(remove_duplicate=False))):
            for name, t in items:
                if id(t) not in self.by_id:
                    self._bind(t, IRTensor(name, tuple(t.shape), t.dtype, kind, t.requires_grad, path=name))
                    self.weights[name] = self.by_id[id(t)]
                    unknown = kind == "param" or t.is_meta          # a meta buffer has no value either
                    self.values.mark(t, Provenance.WEIGHTS if unknown else Provenance.DATA)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _bind(self, t: torch.Tensor, ir: IRTensor) -> IRTensor:
        self.by_id[id(t)] = ir
        self.keep_alive.append(t)
        return ir

    def fresh_name(self, base: str) -> str:
        base = _identifier(base)
        k = self.counts.get(base, 0)
        self.counts[base] = k + 1
        return f"{base}_{k}"

    def lookup(self, t: torch.Tensor) -> IRTensor:
        """The IR tensor for a real tensor; unknown ones are constants captured by the forward."""
        ir = self.by_id.get(id(t))
        if ir is None:
            if self.values.fake_mode is not None and self.values.fake_mode.is_our_fake(t):
                raise NeedsRealValues("forward uses a tensor the tracer did not see being made")
            name = f"const_{len(self.constants)}"
            self.constants[name] = t.detach().clone()
            ir = self._bind(t, IRTensor(name, tuple(t.shape), t.dtype, "constant", False, path=name))
            self.weights[name] = ir
        return ir

    def bind_inputs(self, args: Dict[str, Any]) -> Tuple[List[IRTensor], Any]:
        inputs: List[IRTensor] = []

        def bind(path, x):
            if not isinstance(x, torch.Tensor):
                return x
            name = _identifier("_".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path))
            ir = self._bind(x, IRTensor(name, tuple(x.shape), x.dtype, "input", x.requires_grad, path=path))
            self.values.mark(x, Provenance.DATA)
            inputs.append(ir)
            return ir

        leaves, spec = tree_flatten_with_path(args)
        bound = [bind(p, x) for p, x in leaves]
        return inputs, tree_unflatten(bound, spec)

    # -- recording ------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = target_of(func)
        if target in READS:
            return self.read_value(func, target, args, kwargs)
        try:
            out, call_args, call_kwargs, provenance = self.values.run(func, args, kwargs, self.bind_stand_in)
        except NeedsRealValues as err:
            raise NeedsRealValues(f"{err}, at {self.site()}") from None
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.values.mark(x, provenance)
        node = self.record(target, call_args, call_kwargs, out)
        if node is not None and node.inplace and call_args[0] is not args[0]:
            # a fake call wrote into a real tensor: from now on the tensor is the node's output
            self.by_id[id(args[0])] = self.by_id[id(call_args[0])]
            self.values.demote(args[0], call_args[0])
        return out

    def bind_stand_in(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """A fake call's stand-in for a real tensor is the same graph value."""
        self._bind(fake, self.lookup(real))

    def site(self) -> str:
        return describe_site(self.module_stack[-1] if self.module_stack else "", _user_frame())

    def read_value(self, func, target: str, args, kwargs):
        """A tensor value read into Python: free when static, else a guard (or a refusal)."""
        provenance = self.values.origin_of_call(args, kwargs)
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if provenance is Provenance.STATIC:
            return func(*args, **kwargs)
        name = self.lookup(tensors[0]).name
        if not self.guards:
            raise TraceError(refusal(target, name, self.site()), refused=True)
        if any(self.values.is_fake(t) for t in tensors):
            raise NeedsRealValues(f"forward reads a value computed from the parameters into Python "
                                  f"({read_name(target)} on '{name}' at {self.site()})")
        value = func(*args, **kwargs)
        to_ir = lambda x: self.lookup(x) if isinstance(x, torch.Tensor) else x
        self.nodes.append(guard_node(self.fresh_name("guard"), target, tree_map(to_ir, tuple(args)),
                                     tree_map(to_ir, dict(kwargs)), value,
                                     self.module_stack[-1] if self.module_stack else "", _user_frame()))
        return value

    def record(self, target: str, args, kwargs, out) -> Optional[IRNode]:
        """Add the node for one call (``None`` for bookkeeping calls and plain-value results)."""
        if target in _IGNORED:
            return None
        if out is None and target in INPLACE_TARGETS:     # __setitem__ returns None but writes args[0]
            out = args[0]
        leaves, _ = tree_flatten(out)
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return None                                 # x.size(), x.dim(), ...: plain values
        arg_leaves, arg_spec = tree_flatten((tuple(args), dict(kwargs)))
        ir_args, ir_kwargs = tree_unflatten([self.lookup(x) if isinstance(x, torch.Tensor) else x for x in arg_leaves],
                                            arg_spec)
        spec = spec_of(target)
        base = spec.name if spec and spec.name not in ("elementwise",) else target.rsplit(".", 1)[-1]
        node = IRNode(name=self.fresh_name(base.strip("_") or "op"), target=target,
                      op=spec.name if spec else "opaque", args=ir_args, kwargs=ir_kwargs, outputs=None,
                      module_path=self.module_stack[-1] if self.module_stack else "",
                      source=_user_frame(),
                      inplace=target in INPLACE_TARGETS or (bool(args) and out is args[0]))

        ntensors = sum(isinstance(x, torch.Tensor) for x in leaves)
        made: List[IRTensor] = []

        def new_output(x):
            if not isinstance(x, torch.Tensor):
                return x
            name = node.name if ntensors == 1 else f"{node.name}_{len(made)}"
            made.append(IRTensor(name, tuple(x.shape), x.dtype, "activation", x.requires_grad, producer=node))
            return self._bind(x, made[-1])

        node.outputs = tree_map(new_output, out)
        self.nodes.append(node)
        return node

    # -- module paths ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def module_hooks(self):
        def pre(module, _args):
            name = self.module_names.get(id(module))
            if name is not None:
                self.module_stack.append(name)

        def post(module, _args, _out):
            if self.module_names.get(id(module)) is not None and self.module_stack:
                failing = sys.exc_info()[0] is not None
                if failing and self.failed_in is None:        # the innermost module that raised
                    self.failed_in = self.module_stack[-1]
                self.module_stack.pop()

        h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


# ------------------------------------------------------------------------------------------------
def check_forward_args(module: torch.nn.Module, dummy_forward_args: Dict[str, Any]) -> inspect.Signature:
    """Raise a ``TraceError`` naming the problem when the dummy args cannot be passed by keyword."""
    if not isinstance(dummy_forward_args, dict):
        raise TraceError("dummy_forward_args must be a dict from forward's argument names to values, "
                         f"got {type(dummy_forward_args).__name__}; e.g. {{'x': torch.randn(2, 16)}}.")
    sig = inspect.signature(module.forward)
    params = sig.parameters
    for p in params.values():
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TraceError(f"{type(module).__name__}.forward has the positional-only argument {p.name!r}; "
                             "nbscaler passes arguments by name: remove the '/' from forward's signature.")
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in dummy_forward_args:
        if key not in params and not takes_kwargs:
            raise TraceError(f"dummy_forward_args has {key!r}, which {type(module).__name__}.forward does not take "
                             f"(it takes {', '.join(params) or 'nothing'}).")
    for p in params.values():
        if (p.default is inspect.Parameter.empty and p.name not in dummy_forward_args
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)):
            raise TraceError(f"dummy_forward_args lacks {p.name!r}, which {type(module).__name__}.forward needs.")
    return sig


def trace_module(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], mode: str = "train", *,
                 fake: bool = True, guards: bool = True) -> IRGraph:
    """Trace ``module.forward(**dummy_forward_args)`` in ``mode`` ('train' or 'eval').

    ``fake`` runs the calls that read parameters on shapes only (the default; a forward that needs
    their values is traced again for real, with a warning). ``guards=False`` refuses control flow on
    values read from the input data instead of specialising on them (see ``nbscaler.trace.guards``).
    The module's state (buffers such as BatchNorm's running statistics, the RNG, the train/eval
    flag) is the same afterwards as before. ``graph.meta['reads_training']`` says whether forward
    read any module's ``training`` flag.

    >>> g = trace_module(torch.nn.Linear(4, 2), {'input': torch.randn(3, 4)})
    >>> [n.target for n in g.nodes]
    ['torch.nn.functional.linear']
    """
    check_forward_args(module, dummy_forward_args)
    on_meta = has_meta_tensors(module)
    if not fake and not on_meta:
        return _trace_once(module, dummy_forward_args, mode, False, guards)
    try:
        return _trace_once(module, dummy_forward_args, mode, True, guards)
    except TraceError as err:
        if err.refused:
            raise
        if on_meta:
            raise TraceError(meta_refusal(type(module).__name__, str(err)), refused=True) from err
        reason = str(err)
    graph = _trace_once(module, dummy_forward_args, mode, False, guards)   # a real failure raises here
    warnings.warn(f"nbscaler: {type(module).__name__} was traced on real tensors, which runs its forward "
                  f"(slower than tracing shapes only), because {reason}", stacklevel=2)
    return graph


def _trace_once(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], mode: str, fake: bool,
                guards: bool) -> IRGraph:
    was_training = module.training
    saved_buffers = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()
                     if not isinstance(v, torch.nn.Parameter)}
    tracer = Tracer(module, fake=fake, guards=guards, meta_device=_inputs_device(dummy_forward_args))
    inputs, input_spec = tracer.bind_inputs(dummy_forward_args)
    module.train(mode == "train")
    reads: List[torch.nn.Module] = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), tracer.module_hooks(), watch_training_reads(reads), \
                stand_ins(module), tracer:
            out = module(**dummy_forward_args)
        outputs = tree_map(lambda x: tracer.lookup(x) if isinstance(x, torch.Tensor) else x, out)
    except TraceError:
        raise
    except NeedsRealValues as err:
        raise TraceError(str(err)) from err
    except Exception as err:
        where = f" in {tracer.failed_in}" if tracer.failed_in else ""
        raise TraceError(f"tracing {type(module).__name__}.forward failed{where}: {type(err).__name__}: {err}") from err
    finally:
        module.train(was_training)
        with torch.no_grad():
            state = module.state_dict(keep_vars=True)
            for k, v in saved_buffers.items():
                state[k].copy_(v)
    for node in tracer.nodes:
        node.annotation = annotate(node) if node.op != GUARD_OP else None
    sig = inspect.signature(module.forward)
    forward_params = [(p.name, p.kind.name, p.name in dummy_forward_args) for p in sig.parameters.values()]
    non_persistent = [f"{prefix}{'.' if prefix else ''}{b}" for prefix, m in module.named_modules()
                      for b in getattr(m, "_non_persistent_buffers_set", ())]
    return IRGraph(nodes=tracer.nodes, inputs=inputs, input_spec=input_spec, outputs=outputs,
                   weights=tracer.weights, mode=mode,
                   meta={"constants": tracer.constants, "module": type(module).__qualname__,
                         "forward_params": forward_params, "non_persistent": non_persistent,
                         "reads_training": bool(reads), **module_tree(module)})


def has_meta_tensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has a shape, no values)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def meta_refusal(module_name: str, reason: str) -> str:
    """The message of the ``TraceError`` raised when forward needs values a meta module lacks."""
    return (f"{module_name} is on the meta device, so its parameters and buffers have shapes but no values, "
            f"and its forward needs values: {reason}. Keep the value a tensor in forward (torch.where instead "
            "of `if`, no .item()), compute it in __init__ from the config, or build the module on a real "
            "device to plan it.")


def _inputs_device(args: Dict[str, Any]) -> torch.device:
    """The device of the first tensor argument (the CPU when there is none, or it is meta itself)."""
    for x in tree_flatten(args)[0]:
        if isinstance(x, torch.Tensor) and not x.is_meta:
            return x.device
    return torch.device("cpu")


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def module_tree(module: torch.nn.Module) -> Dict[str, Any]:
    """``graph.meta`` facts naming the module's sub-modules: ``module_classes`` (path -> class name,
    ``''`` for the root) and ``module_containers`` (the paths of ModuleLists, ModuleDicts and
    Sequentials, whose children are the layers a user means by the container's name) and
    ``linear_modules`` (the paths of ``nn.Linear`` layers, subclasses included: the layers whose
    products ``Recipe(float8=...)`` takes in fp8)."""
    modules = dict(module.named_modules())
    return {"module_classes": {path: type(m).__name__ for path, m in modules.items()},
            "module_containers": [path for path, m in modules.items() if path and isinstance(m, _CONTAINERS)],
            "linear_modules": [path for path, m in modules.items() if isinstance(m, torch.nn.Linear)]}
