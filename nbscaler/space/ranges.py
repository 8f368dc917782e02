"""The ranges a sweep combines (``nbscaler.sweep``'s ``tp``, ``pp``, ``micro_batch``, ...), checked
on a target, and why a combination of them cannot run there."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from nbscaler.config import RecomputeGranularity
from nbscaler.cost.hardware import Hardware
from nbscaler.layouts import ContextKind
from nbscaler.planning.stack import Stack
from nbscaler.recipe import Float8Scaling, Recipe

#: What a sweep tries for ``recompute`` unless told: nothing, the attention cores, each whole layer.
RECOMPUTE_VALUES = tuple(g.value for g in RecomputeGranularity)
#: The context-parallel kinds a sweep tries unless told: the policy's own default, keys all-gathered.
CONTEXT_KIND_VALUES = (ContextKind.ALL_GATHER.value,)


@dataclasses.dataclass(frozen=True)
class Ranges:
    """The sweep's ranges as the user gave them (``None``: every divisor, worked out per target)."""

    tp: Optional[Tuple[int, ...]]
    pp: Optional[Tuple[int, ...]]
    micro_batch: Optional[Tuple[int, ...]]
    recompute: Tuple[str, ...]
    sequence_parallel: Tuple[bool, ...]
    zero_stage: Tuple[int, ...]
    scheduler: str
    virtual_stages: Tuple[int, ...]
    zero_reshard_after_forward: Tuple[bool, ...] = (True,)
    cp: Tuple[int, ...] = (1,)
    context_parallel_kind: Tuple[str, ...] = CONTEXT_KIND_VALUES
    float8: Optional[Tuple[str, ...]] = None        # None: the recipe's
    compiled: Optional[Tuple[bool, ...]] = None     # None: the target's software's
    ep: Tuple[int, ...] = (1,)


#: How a sweep's ``float8`` column reads a recipe without fp8 products.
NO_FLOAT8 = "none"


def software_ranges(hardware: Hardware, recipe: Recipe, float8: Optional[Sequence], compiled: Optional[Sequence],
                    stack_path: str) -> List[Tuple[str, bool]]:
    """The (``float8``, ``compiled``) pairs a sweep tries, checked: ``float8`` some of ``'none'`` (or
    ``None``), ``'tensorwise'``, ``'rowwise'`` (default: the recipe's), ``compiled`` True and/or
    False (default: the target's software's). fp8 on a target without fp8 units is refused by name,
    and so is a target compiling other modules than each layer of ``stack_path`` (``at_software``)."""
    software = hardware.software
    if software.compiled and software.compiled_modules != (stack_path,):
        raise ValueError(f"sweep: the target's software compiles {software.compiled_modules or 'the whole model'}; a "
                         f"sweep compiles each layer of {stack_path} on its own, so that every layer prices alike. Give "
                         f"the target Software(compiled=False) and sweep compiled=(True,), or compiled_modules="
                         f"({stack_path!r},).")
    float8 = [recipe.float8.value if recipe.float8 else NO_FLOAT8] if float8 is None else list(float8)
    known = [NO_FLOAT8, *(k.value for k in Float8Scaling)]
    named = [NO_FLOAT8 if v is None else str(v) for v in float8]
    if not named or any(v not in known for v in named):
        raise ValueError(f"sweep's float8={tuple(float8)!r}: give some of {', '.join(map(repr, known))}.")
    if any(v != NO_FLOAT8 for v in named):
        hardware.require_fp8(f"sweep's float8={tuple(float8)!r}")
    compiled = [hardware.software.compiled] if compiled is None else list(compiled)
    if not compiled or any(not isinstance(v, bool) for v in compiled):
        raise ValueError(f"sweep's compiled={tuple(compiled)!r}: give True and/or False.")
    return [(f, c) for f in dict.fromkeys(named) for c in dict.fromkeys(compiled)]


def at_software(hardware: Hardware, recipe: Recipe, float8: str, compiled: bool, stack_path: str
                ) -> Tuple[Hardware, Recipe]:
    """The target running ``compiled`` software (each layer of the stack at ``stack_path`` compiled
    on its own, as torchtitan compiles each transformer block) and the recipe with ``float8``
    products (``'none'``: none, and none of the recipe's ``float8_skip``)."""
    if compiled != hardware.software.compiled:
        modules = (stack_path,) if compiled else ()
        hardware = hardware.running(hardware.software.replace(compiled=compiled, compiled_modules=modules))
    if float8 == NO_FLOAT8:
        return hardware, recipe.replace(float8=None, float8_skip=())
    return hardware, recipe.replace(float8=float8)


def context_kind_at(cp: int, values: Sequence[str]) -> List[str]:
    """The context-parallel kinds to try at ``cp``: with one device per stage's sequence there are
    no keys to pass, so only the first given (never a second, identical row)."""
    return list(dict.fromkeys(values)) if cp > 1 else [values[0]]


def reshard_at(zero_stage: int, values: Sequence[bool]) -> List[bool]:
    """The ``zero_reshard_after_forward`` values to try at ``zero_stage``: only stage 3 gathers
    parameters, so the other stages take ``True`` alone (never a second, identical row)."""
    return sorted(set(values), reverse=True) if zero_stage == 3 else [True]


def sequence_parallel_at(tp: int, values: Sequence[bool]) -> List[bool]:
    """The sequence parallelism to try at ``tp``: with one device there are no linears' ops to
    slice the sequence between, so only ``False`` (never a second, identical row)."""
    return sorted({v and tp > 1 for v in values})


def virtual_stages_of(scheduler: str, values: Sequence[int]) -> List[int]:
    """The stages per pipeline device to try: the scheduler's own number where it has one."""
    from nbscaler.schedule.schedulers import scheduler_spec
    fixed = scheduler_spec(scheduler).stages_per_device
    if fixed is not None:
        return [fixed]
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or not values:
        raise ValueError(f"sweep's virtual_stages={tuple(values)!r}: give whole numbers >= 1.")
    return list(values)


def recompute_values(values: Sequence) -> List[str]:
    """The sweep's ``recompute`` values as granularities (``'none'``, ``'selective'``, ``'full'``), in
    the order given, each once; ``True`` and ``False`` are shorthands for ``'full'`` and ``'none'``.

    >>> recompute_values([False, True, "selective"])
    ['none', 'full', 'selective']
    """
    out: List[str] = []
    for v in values:
        value = {True: "full", False: "none"}[v] if isinstance(v, bool) else v
        if value not in RECOMPUTE_VALUES:
            raise ValueError(f"sweep's recompute={tuple(values)!r}: give some of {', '.join(map(repr, RECOMPUTE_VALUES))} "
                             "(True and False stand for 'full' and 'none').")
        if str(value) not in out:
            out.append(str(RecomputeGranularity(value).value))
    if not out:
        raise ValueError(f"sweep's recompute={tuple(values)!r}: give some of {', '.join(map(repr, RECOMPUTE_VALUES))}.")
    return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def checked_ranges(hardware: Hardware, stack: Stack, global_batch: int, tp, pp, micro_batch, recompute,
            sequence_parallel, zero_stage, zero_reshard_after_forward: Sequence[bool] = (True,),
            cp: Sequence[int] = (1,), context_parallel_kind: Sequence[str] = CONTEXT_KIND_VALUES,
            ep: Sequence[int] = (1,)) -> Tuple[List, ...]:
    """The values to combine, each checked on its own (``ValueError`` naming the bad one): ``tp``,
    ``pp``, ``micro_batch``, ``recompute``, ``sequence_parallel``, ``zero_stage``,
    ``zero_reshard_after_forward``, ``cp``, ``context_parallel_kind`` and ``ep``, in that order."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a whole number of sequences >= 1.")
    gpus = hardware.ngpus
    tp = list(tp) if tp is not None else _divisors(gpus)
    pp = list(pp) if pp is not None else [d for d in _divisors(gpus) if d <= stack.depth]
    micro_batch = list(micro_batch) if micro_batch is not None else _divisors(global_batch)
    cp, ep = list(cp), list(ep)
    for name, values in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp), ("micro_batch", micro_batch)):
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad or not values:
            raise ValueError(f"sweep's {name}={values!r}: give whole numbers >= 1.")
    for name, values in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp)):
        bad = [v for v in values if gpus % v]
        if bad:
            raise ValueError(f"sweep's {name} values {bad} do not divide the {gpus} GPUs of {hardware.name} "
                             f"x {hardware.nodes} node(s); use divisors of {gpus}: {_divisors(gpus)}.")
    if max(pp) > stack.depth:
        raise ValueError(f"sweep's pp={max(pp)} is more stages than the {stack.depth} layers of {stack.path}; "
                         f"use pp <= {stack.depth}.")
    bad = [z for z in zero_stage if z not in (0, 1, 2, 3) or isinstance(z, bool)]
    if bad or not zero_stage:
        raise ValueError(f"sweep's zero_stage={tuple(zero_stage)!r}: use 0 (no ZeRO), 1, 2 or 3.")
    if not sequence_parallel or any(not isinstance(v, bool) for v in sequence_parallel):
        raise ValueError(f"sweep's sequence_parallel={tuple(sequence_parallel)!r}: give True and/or False.")
    reshard = zero_reshard_after_forward
    if not reshard or any(not isinstance(v, bool) for v in reshard):
        raise ValueError(f"sweep's zero_reshard_after_forward={tuple(reshard)!r}: give True and/or False.")
    kinds = list(context_parallel_kind)
    if not kinds or any(k not in {c.value for c in ContextKind} for k in kinds):
        raise ValueError(f"sweep's context_parallel_kind={tuple(kinds)!r}: give some of "
                         f"{', '.join(repr(c.value) for c in ContextKind)}.")
    recompute = recompute_values(recompute)
    return tp, pp, micro_batch, recompute, list(sequence_parallel), list(zero_stage), list(reshard), cp, kinds, ep


def combination_problem(hardware: Hardware, global_batch: int, tp: int, pp: int, micro: int, cp: int = 1,
                        sequence: Optional[int] = None, ep: int = 1) -> Optional[str]:
    """Why ``tp`` x ``cp`` x ``ep`` x ``pp`` with ``micro``-sequence micro-batches of ``sequence``
    tokens cannot run, or ``None``. Whether ``ep`` runs beside the others is the policy's word
    (``policy.experts.check_experts``), asked when the row's copy is placed."""
    width = tp * cp * ep * pp
    if hardware.ngpus % width:
        named = " x ".join(name for name, size in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp))
                           if size > 1 or name in ("tp", "pp"))
        return f"{named} = {width} does not divide the {hardware.ngpus} GPUs"
    if cp > 1 and sequence is not None and sequence % (2 * cp):
        return (f"cp={cp} cuts the sequence into 2 x {cp} = {2 * cp} chunks, but it has {sequence} tokens "
                f"(use a cp that divides {sequence // 2}, or a multiple of {2 * cp} tokens)")
    dp = hardware.ngpus // width
    if global_batch % (dp * micro):
        return f"the global batch {global_batch} is not a multiple of dp x micro_batch = {dp} x {micro}"
    return None
