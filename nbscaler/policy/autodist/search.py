"""The search: choose every op's split by dynamic programming over the graph's order.

The cost of a plan is a sum of terms that each involve one op (its time on its share, and ``weight``
times the bytes it keeps) or one edge (the collectives between a producer's choice and a consumer's
choice). Walking the ops in order, the only past choices that still matter are those of the ops
whose outputs are yet to be read: the *open* ops. So the state after op ``i`` is the tuple of the
open ops' choices, and for each state the search keeps the cheapest way to reach it:

    best[i](state') = min over state, choice_i of
                      best[i-1](state) + op(i, choice_i) + sum of edges(j -> i) under state

In a transformer few outputs are open at once (the residual stream, the normed input of q/k/v),
so the states stay few and the result is the exact optimum of this cost. Where a graph keeps many
outputs open (wide skips), the search keeps the ``max_states`` cheapest states per op and says so:
the result is then the best it found. Ties go to the earlier choice, so a search is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from nbscaler.ir.graph import IRNode
from nbscaler.policy.autodist.costs import Choice, ChoiceCosts


@dataclass
class SearchResult:
    choices: Dict[int, Choice]       # id(node) -> choice
    cost: float                      # seconds + weight * bytes, as searched
    exact: bool                      # False when states were dropped
    states: int                      # the most states held at once


def search(nodes: Sequence[IRNode], costs: ChoiceCosts, pin_of: Callable[[str], Optional[str]],
           bytes_weight: float = 0.0, max_states: int = 4096) -> SearchResult:
    """The cheapest choice for each of ``nodes`` (a whole graph, or one pipeline stage).

    A state holds, for each open op, the layouts its choice leaves its outputs in: what later
    edges cost depends on nothing else, so choices that leave the same layouts share a state.
    """
    position = {id(n): i for i, n in enumerate(nodes)}
    last_read = _last_reads(nodes, position)
    data = _reads_data(nodes)
    options = [costs.choices(n, "replicate" if not data[i] else pin_of(n.module_path)) for i, n in enumerate(nodes)]
    open_ops: List[int] = []                              # positions, in order
    states: Dict[Tuple, float] = {(): 0.0}
    back: List[Dict[Tuple, Tuple[Tuple, Choice]]] = []
    exact, widest = True, 1
    for i, node in enumerate(nodes):
        producers = _producer_slots(node, open_ops, position)
        keep = [k for k, j in enumerate(open_ops) if last_read[j] != i]
        opens = last_read.get(i, -1) > i
        step: Dict[Tuple, Tuple[float, Tuple, Choice]] = {}
        for choice in options[i]:
            own = costs.op_seconds(node, choice) + bytes_weight * costs.op_bytes(node, choice)
            layouts = costs.output_layouts(node, choice)
            for state, so_far in states.items():
                cost = so_far + own
                for index, slot, k in producers:
                    have = state[slot][k] if slot is not None else costs.source_layout(node.inputs[index], None)
                    cost += costs.edge_seconds(have, node, index, choice)
                new = tuple(state[k] for k in keep) + ((layouts,) if opens else ())
                if new not in step or cost < step[new][0]:
                    step[new] = (cost, state, choice)
        still_open = [nodes[open_ops[k]] for k in keep] + ([node] if opens else [])
        step = _prune(step, costs.regret_bound(still_open, node),
                      lambda k, a, b: costs.switch_seconds(still_open[k], a, b, node))
        if len(step) > max_states:
            exact = False
            step = dict(sorted(step.items(), key=lambda kv: kv[1][0])[:max_states])
        widest = max(widest, len(step))
        states = {s: c for s, (c, _, _) in step.items()}
        back.append({s: (prev, choice) for s, (_, prev, choice) in step.items()})
        open_ops = [open_ops[k] for k in keep] + ([i] if opens else [])
    state, cost = min(states.items(), key=lambda kv: kv[1])
    chosen: Dict[int, Choice] = {}
    for i in range(len(nodes) - 1, -1, -1):
        state, choice = back[i][state]
        chosen[id(nodes[i])] = choice
    return SearchResult(chosen, cost, exact, widest)


def _prune(step: Dict, bound: float, switch: Callable[[int, Tuple, Tuple], float]) -> Dict:
    """Drop the states that cannot win, keeping the search exact.

    Any state can be turned into any other by converting each open output once per remaining read,
    which costs at most ``bound``: a state costing more than the cheapest plus ``bound`` never wins.
    Finer: of two states that differ only in slot ``k`` (layouts ``a`` against ``b``), the one
    with ``b`` never wins if it costs more than the other plus ``switch(k, a, b)``, the cost of
    bringing that output from ``a`` to ``b`` at each of its remaining reads.
    """
    best = min(cost for cost, _, _ in step.values())
    step = {s: v for s, v in step.items() if v[0] <= best + bound}
    width = len(next(iter(step)))
    for k in range(width):
        if len(step) <= 1:
            break
        groups: Dict[Tuple, List[Tuple]] = {}
        for s in step:
            groups.setdefault(s[:k] + s[k + 1:], []).append(s)
        for members in groups.values():
            members.sort(key=lambda s: step[s][0])
            kept: List[Tuple] = []
            for s in members:
                if all(step[s][0] < step[o][0] + switch(k, o[k], s[k]) for o in kept):
                    kept.append(s)
                else:
                    del step[s]
    return step


def _reads_data(nodes: Sequence[IRNode]) -> List[bool]:
    """Whether each op depends on the module's inputs. Ops that do not (positions, masks, RoPE
    tables made from shapes and constants) are cheap and read by many later ops; the search keeps
    them replicated instead of carrying their choice through every block."""
    made: Dict[int, bool] = {}
    out = []
    for node in nodes:
        reads = any(t.kind == "input" or made.get(id(t), t.kind == "activation") for t in node.inputs)
        for t in node.output_tensors:
            made[id(t)] = reads
        out.append(reads)
    return out


def _last_reads(nodes: Sequence[IRNode], position: Dict[int, int]) -> Dict[int, int]:
    """Position of each op -> position of the last op among ``nodes`` reading one of its outputs.
    Ops read by no later op here (the module's outputs, a stage's carries) never open a state."""
    last: Dict[int, int] = {}
    for i, node in enumerate(nodes):
        for t in node.inputs:
            if t.producer is not None and id(t.producer) in position:
                j = position[id(t.producer)]
                last[j] = max(last.get(j, j), i)
    return last


def _producer_slots(node: IRNode, open_ops: List[int],
                    position: Dict[int, int]) -> List[Tuple[int, Optional[int], Optional[int]]]:
    """For each input of ``node``: (input index, its producer's slot in the state or None, which
    output of the producer it is)."""
    slot_of = {j: k for k, j in enumerate(open_ops)}
    out = []
    for index, t in enumerate(node.inputs):
        if t.is_weight:
            continue                            # stored the way its readers want it
        j = position.get(id(t.producer)) if t.producer is not None else None
        slot = slot_of.get(j)
        out.append((index, slot, t.producer.output_tensors.index(t) if slot is not None else None))
    return out
