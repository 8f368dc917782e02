"""The tables a ``Plan`` answers with: ops, collectives, and FLOPs, traffic, memory and time per rank.

One *training step* is what the numbers count: the traced batch once (forward and backward), or,
with a pipeline, ``pipeline_nmicros`` micro-batches of it run by the schedule. Runtime rank ``r``
plays plan device ``grid.device_of(r)`` of unit ``grid.unit_of(r)`` (the config's ``RankGrid``);
ranks of different units differ only in the gradient synchronisation between units, and in ZeRO's
share of the optimizer.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

import pandas as pd

from nbscaler.columns import PREDICTED_COLUMNS, SummaryColumn as C
from nbscaler.comm.program import RankProgram, output_shapes
from nbscaler.comm.traffic import CommStep
from nbscaler.recipe import Recipe
from nbscaler.config import ComputeConfig
from nbscaler.cost.comm_model import local_backend
from nbscaler.cost.fsdp import section_units, sent_bytes, step_counts, unit_bytes
from nbscaler.cost.ranks import train_graph
from nbscaler.cost.timing import backend_on, is_zero3
from nbscaler.ir.backward_split import KEY as BACKWARD_PART
from nbscaler.attention.online import held_chunks
from nbscaler.blocks import MIRRORED
from nbscaler.policy.context import CONTEXT_GATHERED, context_kind, sequence_length
from nbscaler.ir.graph import Axis, IRGraph
from nbscaler.ir.layer_rules import parallel_splits
from nbscaler.glossary import GLOSSARY_URL, context_name, split_name, split_text
from nbscaler.layouts import Collective, wire_factor
from nbscaler.planning.expert_tables import experts_html
from nbscaler.planning.step import blocks_per_stage, plan_step, stage_device, target_columns
from nbscaler.units import fmt_bytes, fmt_flops

if TYPE_CHECKING:
    from nbscaler.cost.hardware import Hardware
    from nbscaler.planning.planner import Plan

OP_COLUMNS = ["id", "name", "op", "target", "module", "source_file", "source_line", "stage", "backward_part", "devices", "split",
              "inner_split", "annotation", "in_shapes", "out_shapes", "local_out_shapes", "flops_fwd", "flops_bwd", "bytes_read",
              "bytes_written", "local_flops_fwd"]
COLLECTIVE_COLUMNS = list(CommStep.__dataclass_fields__)


def ops_frame(graph: IRGraph, programs: Iterable[RankProgram]) -> pd.DataFrame:
    """One row per node: where it runs, how it is split, its shapes (the local ones as the rank
    ``programs`` that run every node hold them) and its cost facts; under a zero-bubble schedule,
    ``backward_part`` says which block runs its gradient (``B``, ``W``, ``B+W``;
    ``nbscaler.ir.backward_split``), else ``None``."""
    local_out_shapes = output_shapes(programs, graph)
    rows = []
    for i, n in enumerate(graph.nodes):
        place = n.placement
        outs = n.output_tensors
        rows.append({
            "id": i, "name": n.name, "op": n.op, "target": n.target, "module": n.module_path,
            "source_file": n.source[0] if n.source else None, "source_line": n.source[1] if n.source else None,
            "stage": n.stage, "backward_part": n.meta.get(BACKWARD_PART), "devices": tuple(place.devices) if place else (), "split": place.split if place else None,
            "inner_split": inner_text(place),
            "annotation": str(n.annotation) if n.annotation is not None else None,
            "in_shapes": [tuple(t.shape) for t in n.inputs], "out_shapes": [tuple(t.shape) for t in outs],
            "local_out_shapes": local_out_shapes[id(n)],
            **{key: n.meta.get(key) for key in ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written",
                                               "local_flops_fwd")},
        })
    return pd.DataFrame(rows, columns=OP_COLUMNS)


def inner_text(place) -> Optional[str]:
    """The second cut of a grid placement, ``'n in groups of 2'`` (``'whole in groups of 2'`` where
    each group runs the op whole), or ``None`` for a placement on one axis."""
    if place is None or place.inner is None:
        return None
    return f"{place.inner.name or 'whole'} in groups of {place.inner.parts}"


def collectives_frame(steps: List[CommStep]) -> pd.DataFrame:
    return pd.DataFrame([asdict(s) for s in steps], columns=COLLECTIVE_COLUMNS)


# -- per rank -------------------------------------------------------------------------------------
def edge_traffic_per_device(plan: "Plan", backend: Optional[str] = None) -> Dict[int, Tuple[float, float]]:
    """(bytes sent, bytes received) by each plan device on the graph's edges in one training step,
    as ``backend`` runs the collectives (default: this machine's, ``plan.collectives``)."""
    steps = plan.collectives if backend is None else plan.collectives_on(backend)
    records = list(zip(steps.phase, steps.stage, steps.devices, steps.collective, steps.bytes_per_device))
    ring_sr: Dict[Tuple[int | None, str, int], Tuple[float, float]] = {}

    def block_bytes(stage: int | None, phase: str, where: int) -> Tuple[float, float]:
        """One block's bytes on ring collectives and on sends, as ``where`` runs it."""
        if (stage, phase, where) not in ring_sr:
            rows = [(c, b) for p, s, g, c, b in records
                    if p == phase and where in g and (stage is None or s == stage)]
            ring_sr[(stage, phase, where)] = (float(sum(b for c, b in rows if c != Collective.SEND_RECV)),
                                              float(sum(b for c, b in rows if c == Collective.SEND_RECV)))
        return ring_sr[(stage, phase, where)]

    incoming = defaultdict(float)          # (stage, phase) -> bytes its sends carry
    for p, s, _, c, b in records:
        if c == Collective.SEND_RECV:
            incoming[(s, p)] += b
    out = {}
    for d in range(plan.config.plan_ngpus):
        sent = received = 0.0
        for (stage, phase), count in blocks_per_stage(plan, d).items():
            ring, sends = block_bytes(stage, phase, stage_device(plan, stage, d))
            sent += count * (ring + sends)
            received += count * ring
            if stage is not None:             # what the neighbouring stage sends this way
                source = stage - 1 if phase == "F" else stage + 1
                received += count * incoming[(source, phase)]
        out[d] = (float(sent), float(received))
    return out


def traffic_per_rank(plan: "Plan", param_bytes: Dict[int, float] | None = None,
                     backend: Optional[str] = None, recipe: Optional[Recipe] = None) -> pd.DataFrame:
    """Bytes each runtime rank sends and receives in one training step, as ``backend`` runs the
    collectives (default: the backend of this machine's runs).

    Edge collectives come from ``plan.collectives_on(backend)``. After the backward, parameters whose ops split
    the batch (stored ``R*``) sum their partial gradients over their ``n`` devices (a ring
    all-reduce: ``2 (n-1)/n`` of their bytes); with several units, each rank also synchronises its
    gradients with the same device of the other units (a ring all-reduce, or ZeRO's reduce-scatter
    and all-gather: ``2 (u-1)/u`` of its parameter bytes either way, more where the backend
    emulates the reduce-scatter: ``zero_extra_share``), which needs ``param_bytes`` per rank.
    Under ZeRO stage 3 that synchronisation is instead each unit's all-gathers and reduce-scatters
    in the step (``zero3_sent``; gradients in ``recipe``'s reduce dtype, default ``Recipe()``),
    counted where ``param_bytes`` is given too.
    """
    cfg = plan.config
    edges = edge_traffic_per_device(plan, backend)
    partial = {d: 0.0 if cfg.grid.zero_over_stage else       # ZeRO's reduce-scatter makes these sums
                  sum(2 * (w.partial_over - 1) / w.partial_over * w.nbytes
                      for w in plan.programs.weights(d) if w.kind == "param")
               for d in range(cfg.plan_ngpus)}
    zero3 = zero3_sent(plan, recipe or Recipe(), backend) if param_bytes is not None and is_zero3(cfg) else None
    reduced = {d: reduce_ratio(plan.programs.weights(d), recipe or Recipe()) for d in range(cfg.plan_ngpus)}
    rows = []
    for r in range(cfg.runtime_ngpus):
        sent, received = edges[cfg.device_of(r)]
        if zero3 is not None:
            sync = zero3[cfg.device_of(r)]
        elif param_bytes is not None:
            sync = unit_sync_bytes(cfg, param_bytes[r], reduced[cfg.device_of(r)], backend)
        else:
            sync = 0.0
        sync += partial[cfg.device_of(r)]
        rows.append({C.RANK.value: r, C.BYTES_SENT.value: sent + sync, C.BYTES_RECEIVED.value: received + sync})
    return pd.DataFrame(rows)


def reduce_ratio(weights: Iterable[Any], recipe: Recipe) -> float:
    """Bytes of a device's gradients in ``recipe``'s reduction dtype over its parameters' bytes
    (2 for bf16 parameters reduced in fp32; 1 when no parameter is)."""
    params = [w for w in weights if w.kind == "param"]
    held = sum(w.nbytes for w in params)
    return sum(w.numel * recipe.reduce_dtype(w.dtype).itemsize for w in params) / held if held else 1.0


def unit_sync_bytes(cfg: ComputeConfig, param_bytes: float, ratio: float, backend: Optional[str]) -> float:
    """Bytes a rank sends synchronising its gradients with the same device of the other ``u`` units,
    ``param_bytes`` its parameters' bytes and ``ratio`` its gradients' in the reduction dtype over
    them: a ring all-reduce of the gradients (``2 (u-1)/u``); under ZeRO stages 1 and 2, over
    ZeRO groups of ``z`` in ``g`` groups, a reduce-scatter of the gradients in the group
    (``(z-1)/z``), an all-reduce of this rank's slice across the groups (``2 (g-1)/g`` of ``1/z``)
    and an all-gather of the updated parameters (``(z-1)/z``, in their dtype), plus what a backend
    that emulates the reduce-scatter sends beyond it (``zero_extra_share``). A ZeRO group spans
    the devices of a context-parallel group too where ZeRO splits over them
    (``RankGrid.zero_over_stage``), so it sends even in one unit."""
    u = cfg.units
    grads = ratio * param_bytes
    if not cfg.use_zero:
        return 2 * (u - 1) / u * grads
    z, g = cfg.grid.zero_group_size, cfg.zero_ngroups
    return (grads * ((z - 1) / z + 2 * (g - 1) / (g * z) + zero_extra_share(cfg, backend))
            + param_bytes * (z - 1) / z)


def zero3_sent(plan: "Plan", recipe: Recipe, backend: Optional[str] = None) -> Dict[int, float]:
    """Per plan device, the bytes a rank sends in one step's ZeRO-3 all-gathers and reduce-scatters
    (``cost.fsdp.sent_bytes``): each unit as many times as the step gathers and reduces it
    (``cost.fsdp.step_counts``), as ``backend`` runs them (default: this machine's)."""
    cfg = plan.config
    backend = backend or local_backend(cfg.runtime_ngpus)
    graph = train_graph(plan.graphs)
    group, replicas = cfg.grid.zero_group_size, cfg.zero_ngroups
    out = {}
    for d in range(cfg.plan_ngpus):
        program = plan.programs.device(d)
        units = {sec.stage: section_units(sec) for sec in program.sections if sec.graph is graph}
        unit_of = {n: unit for unit, names in program.units.items() for n in names}
        moved = unit_bytes(program.weights, unit_of.get, group, recipe)
        schedule = plan.geometry.schedule if plan.geometry is not None else None
        pdev = plan.geometry.pipeline_device(d) if plan.geometry is not None else 0
        gathers, reduces = step_counts(units, schedule, pdev, cfg.pipeline_nmicros if cfg.use_pipeline else 1)
        out[d] = sent_bytes(moved, gathers, reduces, group, replicas, backend)
    return out


def zero_extra_share(cfg: ComputeConfig, backend: Optional[str]) -> float:
    """What ZeRO's reduce-scatter over its group of ``z`` sends beyond its ideal ``(z-1)/z`` of the
    parameter bytes where ``backend`` runs it as another collective (0 without ZeRO, or on nccl)."""
    if not cfg.use_zero:
        return 0.0
    z = cfg.grid.zero_group_size
    factor = wire_factor(backend or local_backend(cfg.runtime_ngpus), Collective.REDUCE_SCATTER, z)
    return (factor - 1) * (z - 1) / z if factor != 1 else 0.0


def summary_frame(plan: "Plan", recipe: Recipe, hardware: Optional["Hardware"] = None) -> pd.DataFrame:
    """``Plan.summary``: one row per runtime rank, the columns of ``PREDICTED_COLUMNS``, and on
    ``hardware`` those of ``TARGET_COLUMNS`` too, for a run that trains with ``recipe``. Its step is
    ``plan.step_figures``'s (``planning.step.plan_step``), priced on the memory it shows."""
    cfg = plan.config
    memory = plan.memory(recipe=recipe)
    params = dict(zip(memory[C.RANK.value], memory[C.PARAM_BYTES.value]))
    step = plan_step(plan, recipe, hardware, memory)
    devices = [step.devices[cfg.device_of(r)] for r in range(cfg.runtime_ngpus)]
    frame = pd.DataFrame({C.RANK.value: range(cfg.runtime_ngpus), C.FLOPS.value: [d.flops for d in devices]})
    traffic = traffic_per_rank(plan, params, backend_on(hardware, cfg.runtime_ngpus), recipe)
    frame = frame.merge(traffic, on=C.RANK.value).merge(memory, on=C.RANK.value)
    frame[C.STEP_TIME_S.value] = [d.step_time_s for d in devices]
    frame = frame[[c.value for c in PREDICTED_COLUMNS]].rename(columns=str)
    return target_columns(plan, frame, step) if hardware is not None else frame


# -- saved and shown forms ------------------------------------------------------------------------
def plan_json(plan: "Plan", version: int) -> Dict[str, Any]:
    """A JSON-ready dict of the plan: what ``plan.json`` holds (``format_version`` says its layout)."""
    out: Dict[str, Any] = {"format_version": version, "module": plan.module_name, "policy": plan.policy_name,
                           "compute_config": plan.config.to_dict(), "plan_ngpus": plan.config.plan_ngpus,
                           "graphs": {}, "weights": {}}
    for mode, g in plan.graphs.items():
        out["graphs"][mode] = [
            {"name": n.name, "op": n.op, "target": n.target, "module": n.module_path,
             "devices": list(n.placement.devices), "split": n.placement.split, "blocks": n.placement.blocks,
             "stage": n.stage,
             "annotation": str(n.annotation) if n.annotation else None,
             "inputs": [t.name for t in n.inputs], "outputs": [t.name for t in n.output_tensors],
             **{k: n.meta.get(k) for k in ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written")}}
            for n in g.nodes]
        for name, t in g.weights.items():
            if name in plan.storage:
                out["weights"][name] = {"kind": t.kind, "shape": list(t.shape), "layout": str(plan.storage[name]),
                                        "bytes": t.nbytes}
    out["collectives"] = plan.collectives.assign(devices=plan.collectives.devices.map(list)).to_dict("records")
    if plan.schedule is not None:
        out["schedule"] = plan.schedule.to_dict()
    return out


def split_share(plan: "Plan") -> float:
    """The share of forward FLOPs in ops the policy split (rather than replicated)."""
    ops = plan.ops
    total = ops.flops_fwd.sum()
    return float(ops[ops.split.notna()].flops_fwd.sum() / total) if total else 0.0


def explain_text(plan: "Plan") -> str:
    """What the policy did, in a few lines: split share, heaviest ops, heaviest collectives."""
    ops, coll = plan.ops, plan.collectives
    cfg = plan.config
    lines = [f"{plan.module_name} under '{plan.policy_name}' on {cfg.plan_ngpus} device(s) per unit, "
             f"{cfg.units} unit(s); {len(ops)} ops.",
             f"{split_share(plan):.0%} of the forward FLOPs run in split ops; the rest run replicated."]
    if plan.graph.meta.get("policy_note"):                 # builtin.POLICY_NOTE: what the policy did unasked
        lines.append(plan.graph.meta["policy_note"])
    lines += [context_line(plan, group) for group in context_groups(plan)]
    inside = tensor_groups_inside_context(plan)
    if inside:
        lines.append(f"tensor parallel inside context parallelism: {', '.join(map(str, map(list, inside)))} each run "
                     "every op on their context-parallel place's chunks, split Megatron's way between them "
                     "(their collectives stay inside the group, the keys' cross the groups).")
    gathered = plan.graph.meta.get(CONTEXT_GATHERED)
    if gathered:
        shown = ", ".join(gathered[:6]) + (f" and {len(gathered) - 6} more" if len(gathered) > 6 else "")
        lines.append(f"context parallel: {len(gathered)} op(s) read the sequence but cannot take its split, so they "
                     f"run on the whole sequence, gathered on every device: {shown} (a reshape that merges the batch "
                     "into the sequence does this; a batch of one sequence avoids it).")
    heavy = ops.nlargest(3, "flops_fwd")
    contexts = parallel_splits(plan.graph)
    lines += [f"  heaviest op: {r['name']} ({r['module'] or 'top level'}), {fmt_flops(r['flops_fwd'])}, "
              + (f"split {r['split']!r} ({split_name(r['split'], r['op'], contexts.get(r['name']))}) over "
                 f"{list(r['devices'])}" + (f", {r['inner_split']}" if isinstance(r['inner_split'], str) else "")
                 if isinstance(r['split'], str) else f"replicated on {list(r['devices'])}")
              for _, r in heavy.iterrows()]
    if len(coll):
        per = coll.groupby("collective").bytes_per_device.sum().sort_values(ascending=False)
        lines.append("bytes per device on edges, by collective: " +
                     ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per.items()))
    else:
        lines.append("no collectives on the graph's edges.")
    return "\n".join(lines)


def context_groups(plan: "Plan") -> List[Tuple[Optional[int], Tuple[int, ...]]]:
    """``(stage, devices)`` of each group context parallelism splits a sequence over (stage
    ``None`` without a pipeline; unit 0's plan devices), in stage order; empty without it."""
    found = {(n.stage if plan.geometry is not None else None,
              n.placement.devices if n.placement.inner is None else n.placement.axis_group(Axis.OUTER, d))
             for n in plan.graph.nodes if n.placement is not None and n.placement.split is not None
             and n.placement.blocks == MIRRORED for d in n.placement.devices}
    return sorted(found, key=lambda g: (-1 if g[0] is None else g[0], g[1]))


def tensor_groups_inside_context(plan: "Plan") -> List[Tuple[int, ...]]:
    """The tensor-parallel groups inside context parallelism (each context-parallel place's
    neighbours), in order; empty where context parallelism runs alone."""
    found = {n.placement.axis_group(Axis.INNER, d) for n in plan.graph.nodes
             if n.placement is not None and n.placement.inner is not None and n.placement.blocks == MIRRORED
             for d in n.placement.devices}
    return sorted(found)


def context_kind_text(plan: "Plan") -> str:
    """How its attention reads the other devices' keys, in words."""
    kind = context_kind(plan.config)
    return ("keys and values passed round a ring, one device's block a step" if kind == "ring"
            else "keys and values all-gathered whole before attention")


def context_line(plan: "Plan", group: Tuple[Optional[int], Tuple[int, ...]]) -> str:
    """``context parallel over [0, 1, 2, 3]: device i holds chunks i and 2n-1-i of 2n ...``."""
    stage, devices = group
    n = len(devices)
    where = f"stage {stage}: " if stage is not None else ""
    return (f"context parallel ({context_kind(plan.config)}) over {list(devices)}: {where}the sequence of "
            f"{sequence_length(plan.graph)} tokens in {2 * n} chunks, device i holds chunks i and 2n-1-i "
            f"({context_kind_text(plan)}).")


def context_chunks(plan: "Plan") -> pd.DataFrame:
    """One row per device of each context-parallel group: its stage, the chunks of the sequence it
    holds and their positions (``nbscaler.blocks.ranges``); empty without context parallelism."""
    length, rows = sequence_length(plan.graph) if context_groups(plan) else 0, []
    for stage, devices in context_groups(plan):
        for i, d in enumerate(devices):
            held = held_chunks(length, MIRRORED, len(devices), i)
            rows.append({"stage": stage, "device": d, "chunks": " and ".join(str(c) for c, _, _ in held),
                         "positions": " and ".join(f"{lo}:{hi}" for _, lo, hi in held)})
    return pd.DataFrame(rows, columns=["stage", "device", "chunks", "positions"])


def context_html(plan: "Plan") -> str:
    """The chunks of the sequence each device of context parallelism holds (its groups are in the
    card's text, ``context_line``), or nothing without it."""
    if not context_groups(plan):
        return ""
    chunks = context_chunks(plan)
    if plan.geometry is None:
        chunks = chunks.drop(columns="stage")
    kind = context_kind(plan.config)
    return (f"<div class='nbs-context'><p><b>Context parallelism</b>: the chunks of the {sequence_length(plan.graph)}-token "
            f"sequence each device holds; attention split by its queries, "
            f"{html.escape(context_name('attention', kind))}</p>{chunks.to_html(border=0, index=False)}</div>")


def plan_html(plan: "Plan") -> str:
    """A compact, self-contained HTML card: the plan in one line, then its ops by split, each split
    by its readable name with its label (``nbscaler.glossary``, which the card links to); under
    context parallelism its groups and the chunks of the sequence each device holds; with routed
    experts the experts each device holds (``expert_tables``)."""
    contexts = parallel_splits(plan.graph)
    ops = plan.ops.assign(split=[split_text(s, o, contexts.get(n)) + (f", {inner}" if isinstance(inner, str) else "")
                                 for s, o, n, inner in zip(plan.ops.split, plan.ops.op, plan.ops.name,
                                                           plan.ops.inner_split)])
    by_split = ops.groupby("split").agg(ops=("name", "size"), flops_fwd=("flops_fwd", "sum"))
    by_split["flops_fwd"] = by_split.flops_fwd.map(fmt_flops)
    title = html.escape(repr(plan))
    text = html.escape(explain_text(plan)).replace("\n", "<br>")
    table = by_split.rename_axis("ops by split").to_html(border=0)
    link = f"<a href='{GLOSSARY_URL}' target='_blank'>what the split labels mean</a>"
    return (f"<div class='nbs-plan-card'><b>{title}</b><p style='font-family:monospace;white-space:pre-wrap'>{text}</p>"
            f"{table}{context_html(plan)}{experts_html(plan)}{units_html(plan)}<small>{link}</small></div>")


def units_html(plan: "Plan") -> str:
    """ZeRO stage 3's units of plan device 0 as a small table (``Plan.units``), or nothing."""
    units = plan.units
    if units.empty:
        return ""
    first = units[units.device == 0].drop(columns="device").set_index("unit")
    for column in ("gathered_bytes", "shard_bytes"):
        first[column] = first[column].map(fmt_bytes)
    return f"<p><b>ZeRO-3 units</b> (plan device 0; each rank stores its shard)</p>{first.to_html(border=0)}"
