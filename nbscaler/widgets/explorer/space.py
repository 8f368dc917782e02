"""The Explorer's "space" tab: every configuration of the model on a target, re-priced as knobs turn.

**Sweep** builds a ``space.plan_space.PlanSpace`` of the Explorer's model (the two-layer copy traced
once per micro-batch size, placed once per tp, recompute and sequence parallelism) and draws it
(``widgets.space``; a mark's hover text says whether its configuration is sequence parallel). The knobs
here are the sweep's own: the target (a catalogue name, nodes, GPUs per node), the precision
(the module's dtype and the optimizer's master copies), the global batch and the sequence length.
Turning one re-prices the whole space from what the ``PlanSpace`` kept and reports the time taken;
a click on a mark hands its row to the Explorer, which plans that configuration and shows it in
the graph, plan, timeline and memory panes.

Nothing here prices or plans: ``SpaceTab`` reads and sets widgets, and asks its owner (``say``,
``reporting``, ``on_pick``) for the rest, so it can be driven from code (``set``, ``pick``) as
the browser drives it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import ipywidgets as w
import pandas as pd
import torch

from nbscaler.cost.hardware import Hardware
from nbscaler.recipe import Recipe
from nbscaler.space.plan_space import PlanSpace
from nbscaler.widgets.space import Metric, SpaceWidget, describe, front_rows, space_svg

PRECISIONS: Dict[str, Tuple[Optional[torch.dtype], Optional[torch.dtype]]] = {
    "bf16, fp32 master": (torch.bfloat16, torch.float32),
    "fp16, fp32 master": (torch.float16, torch.float32),
    "bf16, no master copy": (torch.bfloat16, None),
    "fp32": (torch.float32, None),
}
"""The precision knob: its label -> (module dtype, master dtype)."""
SPACE_KNOBS = ("hardware", "nodes", "gpus_per_node", "precision", "global_batch", "sequence", "metric")
DEFAULT_RANGES: Dict[str, Any] = {"micro_batch": (1, 2, 4), "zero_stage": (1, 2, 3)}
"""What the tab sweeps besides every tp and pp that divide the GPUs, recompute none, selective and full, and
sequence parallelism on and off where tp > 1 (``nbscaler.sweep``'s defaults)."""


def one_sequence_of(dummy_args: Dict[str, Any]) -> Dict[str, Any]:
    """``dummy_args`` cut to their first sequence (every tensor's first row), as the sweep takes them."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.ndim >= 1 else t, dummy_args)


class SpaceTab:
    """The knobs, the chart and the **Sweep** button of the space tab.

    ``build(module, dummy_args, optimizer)`` sweeps; ``set(**knobs)`` turns knobs (``SPACE_KNOBS``)
    as the controls do, re-pricing once; ``pick(row)`` clicks the mark of a row of ``frame``.
    """

    def __init__(self, say: Callable[[str], None], reporting: Callable[[str], ContextManager[None]],
                 on_pick: Callable[[pd.Series], None], ranges: Optional[Dict[str, Any]] = None,
                 hardware: str = "H100-SXM-80GB", global_batch: int = 8):
        self.say, self.reporting, self.on_pick = say, reporting, on_pick
        self.ranges = dict(DEFAULT_RANGES if ranges is None else ranges)
        self.space: Optional[PlanSpace] = None
        self._held = False
        style = {"style": {"description_width": "100px"}, "layout": w.Layout(width="250px")}
        self.hardware = w.Dropdown(options=list(Hardware.catalogue()), value=hardware, description="target", **style)
        self.nodes = w.IntText(value=1, description="nodes", **style)
        self.gpus_per_node = w.IntText(value=Hardware.named(hardware).gpus_per_node, description="GPUs per node",
                                       **style)
        self.precision = w.Dropdown(options=list(PRECISIONS), value="bf16, fp32 master", description="precision",
                                    **style)
        self.global_batch = w.IntText(value=global_batch, description="global batch", **style)
        self.sequence = w.IntText(value=0, description="sequence", **style)
        self.metric = w.ToggleButtons(options=[str(m) for m in Metric], value=str(Metric.STEP_TIME),
                                      style={"button_width": "90px"})
        self.sweep_button = w.Button(description="Sweep", button_style="primary", icon="th")
        self.sweep_button.add_class("nbscaler-sweep")
        self.chart = SpaceWidget()
        self.picked = w.HTML("<i>Press <b>Sweep</b> to price every configuration; then click a point to load "
                             "its plan.</i>")
        for knob in (self.hardware, self.nodes, self.gpus_per_node, self.precision, self.global_batch, self.sequence):
            knob.observe(lambda _: self._knobs_changed(), "value")
        self.metric.observe(lambda _: self._draw(), "value")
        self.chart.observe(self._clicked, "selected")
        knobs = w.HBox([w.VBox([self.hardware, self.nodes, self.gpus_per_node]),
                        w.VBox([self.precision, self.global_batch, self.sequence]),
                        w.VBox([self.sweep_button, self.metric])])
        self.widget = w.VBox([knobs, self.chart, self.picked])
        self.widget.add_class("nbscaler-space")

    @property
    def frame(self) -> Optional[pd.DataFrame]:
        """The priced configurations as the chart draws them (``None`` before **Sweep**)."""
        return self.space.frame if self.space is not None else None

    def knobs(self) -> Dict[str, Any]:
        """What the knobs say, as ``PlanSpace.set`` takes it: the precision knob is a change of the
        recipe's ``module_dtype`` and ``master_dtype``."""
        module_dtype, master_dtype = PRECISIONS[self.precision.value]
        return {"hardware": self.hardware.value, "nodes": self.nodes.value, "gpus_per_node": self.gpus_per_node.value,
                "module_dtype": module_dtype, "master_dtype": master_dtype, "global_batch": self.global_batch.value,
                "sequence": self.sequence.value}

    def build(self, module: torch.nn.Module, dummy_args: Dict[str, Any], recipe: Recipe) -> PlanSpace:
        """Sweep ``module`` under the knobs for a run that trains with ``recipe``, its dtypes those
        of the precision knob; the sequence knob takes the dummy inputs' length."""
        knobs = self.knobs()
        target = Hardware.resolve(knobs["hardware"], nodes=knobs["nodes"], gpus_per_node=knobs["gpus_per_node"])
        space = PlanSpace(module, one_sequence_of(dummy_args), target, global_batch=knobs["global_batch"],
                          recipe=recipe.replace(module_dtype=knobs["module_dtype"], master_dtype=knobs["master_dtype"]),
                          **self.ranges)
        self.space = space
        with self._holding():
            self.sequence.value = space.sequence or 0
        self.chart.selected = None
        self._draw()
        self.say(f"Swept {len(space.frame)} configurations on {self._target()} in {space.last_price_s:.2f} s "
                 f"({space.traces} trace(s) of the two-layer copy); click a point to load its plan.")
        return space

    def set(self, **knobs: Any) -> None:
        """Turn knobs from code (``SPACE_KNOBS``; ``precision`` by its label, ``metric`` by
        ``Metric``), re-pricing once for the lot."""
        unknown = sorted(set(knobs) - set(SPACE_KNOBS))
        if unknown:
            raise ValueError(f"the space tab has no knob {', '.join(unknown)}; its knobs are {', '.join(SPACE_KNOBS)}.")
        with self._holding():
            for name, value in knobs.items():
                getattr(self, name).value = str(value) if name == "metric" else value
        self._knobs_changed()

    def pick(self, row: int) -> None:
        """Click the mark of row ``row`` of ``frame``."""
        if self.chart.selected == row:
            self._clicked({"new": row})            # the same mark again: load it again
        self.chart.selected = row

    # -- reacting ---------------------------------------------------------------------------------
    def _knobs_changed(self) -> None:
        if self._held or self.space is None:
            return
        with self.reporting("re-price the space"):
            traces = self.space.traces
            frame = self.space.set(**self.knobs())
            self.chart.selected = None
            self._draw()
            traced = self.space.traces - traces
            how = "from cached costs, nothing traced" if not traced else \
                f"the two-layer copy traced again {traced} time(s): the sequence or the dtype changed"
            self.say(f"Re-priced {len(frame)} configurations on {self._target()} in "
                     f"{self.space.last_price_s * 1e3:.0f} ms ({how}).")

    def _clicked(self, change: Dict[str, Any]) -> None:
        row = change["new"]
        if row is None or self.space is None:
            return
        self._draw()
        with self.reporting("load the configuration"):
            chosen = self.space.frame.iloc[row]
            self.picked.value = f"<b>Loaded:</b> {describe(chosen)}"
            self.on_pick(chosen)

    def _draw(self) -> None:
        if self.space is None:
            return
        frame = self.space.frame
        self.chart.svg = space_svg(frame, self.space.hardware, Metric(self.metric.value), self.chart.selected)
        self.front = front_rows(frame)

    def _target(self) -> str:
        hw = self.space.hardware
        return f"{hw.name}, {hw.nodes} node(s) of {hw.gpus_per_node} GPUs"

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        self._held = True
        try:
            yield
        finally:
            self._held = False

