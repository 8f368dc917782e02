"""Save a chosen plan as readable JSON, and place a graph from such a file (edited or not).

One entry per op, in graph order, named as in the generated code, for each traced mode (``any``,
or ``train`` and ``eval`` for a model whose modes differ, such as one with BatchNorm)::

    {"format": "nbscaler-autodist-plan", "version": 2, "plan_ngpus": 2,
     "modes": {"any": [{"name": "linear_3", "module": "blocks.0.mlp.fc",
                        "target": "torch.nn.functional.linear", "split": "n", "stage": null}, ...]}}

``split`` is a dim name of the op's annotation or ``"replicate"``; ``stage`` is the pipeline stage;
``blocks`` (only where it is not 1) makes the split strided, as for a fused qkv projection.
Editing a ``split`` and loading the file back (``pas_config={'load_plan_path': ...}``) is how a
plan is tuned by hand; a file that does not fit the graph is refused with the first op that differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

from nbscaler.blocks import normalize
from nbscaler.genfiles import atomic_write_bytes
from nbscaler.ir.graph import IRGraph, IRNode, Placement
from nbscaler.ir.layer_rules import context_parallel
from nbscaler.policy.primitives import PolicyError, partition, replicate

FORMAT, VERSION = "nbscaler-autodist-plan", 2


def save_plan(graph: IRGraph, plan_ngpus: int, path: str) -> None:
    """Write the placement of every op of ``graph`` to ``path`` (atomically), under its mode. The
    other modes a file of the same unit size holds are kept: a plan places its modes one by one."""
    ops = [{"name": n.name, "module": n.module_path, "target": n.target,
            "split": n.placement.split or "replicate", "stage": n.stage,
            **({"blocks": n.placement.blocks} if n.placement.blocks != 1 else {})} for n in graph.nodes]
    modes = {}
    try:
        old = json.loads(Path(path).read_text())
        if (old.get("format"), old.get("version"), old.get("plan_ngpus")) == (FORMAT, VERSION, plan_ngpus):
            modes = old.get("modes", {})
    except (OSError, ValueError):
        pass
    modes[graph.mode] = ops
    data = {"format": FORMAT, "version": VERSION, "plan_ngpus": plan_ngpus, "modes": modes}
    atomic_write_bytes(Path(path), json.dumps(data, indent=1).encode())


def _read(path: str) -> Dict[str, Any]:
    try:
        data: Dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PolicyError(f"cannot read the autodist plan {path}: {err}") from None
    if data.get("format") != FORMAT or not isinstance(data.get("plan_ngpus"), int):
        raise PolicyError(f"{path} is not an autodist plan (it says format={data.get('format')!r}, "
                          f"plan_ngpus={data.get('plan_ngpus')!r}); save one with pas_config['save_plan_path'].")
    return data


def saved_plan_ngpus(path: str) -> int:
    """The devices per unit the plan at ``path`` was saved for."""
    return _read(path)["plan_ngpus"]


def load_plan(graph: IRGraph, plan_ngpus: int, path: str,
              devices_of_stage: Callable[[Any], Tuple[int, ...]]) -> IRGraph:
    """Place ``graph`` as the file at ``path`` says; ``devices_of_stage(stage)`` gives each op's devices."""
    data = _read(path)
    if data["plan_ngpus"] != plan_ngpus:
        raise PolicyError(f"{path} is an autodist plan for plan_ngpus={data['plan_ngpus']}, not {plan_ngpus}: "
                          "set plan_ngpus to match, or let autodist take it (autodist_plan_ngpus='auto').")
    modes = data.get("modes", {"any": data.get("ops", [])})      # version 1 held one mode's ops
    ops = modes.get(graph.mode, modes.get("any"))
    if ops is None:
        raise PolicyError(f"{path} places the modes {sorted(modes)}, not {graph.mode!r}: it was saved for a model "
                          "whose train and eval graphs differ in another way. Search again (drop load_plan_path).")
    if len(ops) != len(graph.nodes):
        raise PolicyError(f"{path} places {len(ops)} ops, but the traced graph has {len(graph.nodes)}: it was "
                          "saved for another model or other inputs. Search again (drop load_plan_path).")
    for node, op in zip(graph.nodes, ops):
        if (op.get("name"), op.get("target")) != (node.name, node.target):
            raise PolicyError(f"{path}: op {op.get('name')!r} ({op.get('target')}) stands where the graph has "
                              f"{node.name} ({node.target}); the file was saved for another model.")
        node.stage = op.get("stage")
        devices = devices_of_stage(node.stage)
        split = op.get("split", "replicate")
        if split == "replicate" or len(devices) == 1:
            replicate(node, devices)
        elif not _own_call(node, split, devices, normalize(op.get("blocks", 1))):
            partition(node, split, devices, blocks=normalize(op.get("blocks", 1)))   # refuses a dim the op cannot split along
    return graph


def _own_call(node: IRNode, split: str, devices: Tuple[int, ...], blocks) -> bool:
    """Place ``node`` split along frozen ``split`` where it runs a call of its own for that split (a
    mean loss split along its tokens: each device's part, ``split_cross_entropy``); ``False``, placing
    nothing, for any other op, which ``partition`` then refuses by name."""
    if node.annotation is None or split not in node.annotation.frozen:
        return False
    node.placement = Placement(tuple(devices), split, blocks)
    if context_parallel(node) == "loss":
        return True
    node.placement = None
    return False
