"""``Explorer``: one notebook app that ties the views to policy and knob controls and to a cluster.

>>> ex = Explorer()                       # the shipped GPT; or Explorer(my_model, {'x': x})   # doctest: +SKIP
>>> ex                                    # controls, graph, plan, code, why, timeline, memory, losses, runs
>>> ex.set(policy="pp", stages=2)         # what turning the knobs does: re-place, redraw timeline + memory
>>> ex.compile(); ex.train()              # the buttons
>>> ex.runs                               # every run so far, as a DataFrame
>>> ex.sweep(); ex.space.set(nodes=2)     # the space tab: every configuration on a target, re-priced
>>> ex.space.pick(0)                      # load the fastest one into the graph, plan, timeline, memory

The Explorer holds no numbers of its own: a compile is ``nbscaler.plan``, a knob change is
``Plan.replan`` (the traced graphs are placed again, not traced again), a run is ``Cluster``
telemetry, and the views draw those objects. What it adds is the wiring, the runs table, and
error handling: whatever fails (a bad knob, a policy that refuses a config, a failing rank) is shown
in the widget as a message, and the Explorer keeps working.
"""

from __future__ import annotations

import contextlib
import html
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import ipywidgets as w
import pandas as pd
import torch

import nbscaler
from nbscaler.cluster import Cluster, ClusterError, RankError
from nbscaler.columns import SweepColumn
from nbscaler.planning import Plan
from nbscaler.planning.stack import find_stack, one_sequence
from nbscaler.recipe import UNSET, Recipe
from nbscaler.widgets.explorer.compare import Comparison
from nbscaler.widgets.explorer.controls import SHIPPED_GPT, Controls
from nbscaler.widgets.explorer.knobs import Knobs
from nbscaler.widgets.explorer.losses import LossCurve
from nbscaler.widgets.explorer.model import LossFn, ModelSpec, shipped_gpt, user_model
from nbscaler.widgets.explorer.panes import PLACEMENT_VIEWS, Panes, ViewName, view_options
from nbscaler.widgets.explorer.runs import EXPLORER_RECIPE, Run, runs_frame
from nbscaler.widgets.explorer.snapshot import snapshot_html
from nbscaler.widgets.explorer.space import SpaceTab
from nbscaler.widgets.space import describe
from nbscaler.widgets.explorer.trainer import TrainOutcome, TrainSettings, train_on_cluster

TABS = (ViewName.GRAPH, ViewName.PLAN, ViewName.CODE, ViewName.WHY)
SPACE_TAB = "space"


class Explorer:
    """Choose a model, a policy and the compute knobs; compile, train on a cluster, compare runs.

    Args:
        model: a ``torch.nn.Module`` to explore; ``None`` for the shipped GPT (small by default).
        dummy_args: its forward arguments, as for ``nbscaler.plan`` (needed with ``model``).
        cluster: the ``Cluster`` to train on; ``None`` starts one of ``runtime_ngpus`` engines on the
            first Train (and a new one when that number changes).
        policies: user policy functions ``(graph, compute_config) -> graph`` to offer besides the
            built-in ones.
        loss_fn: ``loss_fn(output, batch)`` for a model that does not return its loss.
        knobs: the initial ``Knobs`` (policy and compute settings).
        recipe: the training recipe the predictions assume (``nbscaler.Recipe``; default
            ``EXPLORER_RECIPE``, plain SGD, which training uses too, as the single-process oracle does).
        optimizer_fn: the optimizer class training uses: a shorthand for the recipe's.
        hardware: a target (``nbscaler.Hardware``) the timeline and memory views draw the plan on
            (its step, bubble and MFU; its capacity and the ranks that do not fit); ``None`` for
            this machine.
        sweep_ranges: what the space tab sweeps (``nbscaler.sweep``'s ``tp``, ``pp``,
            ``micro_batch``, ``recompute``, ``sequence_parallel``, ``zero_stage``, ``cp``,
            ``context_parallel_kind``, ``ep``, ...); ``None`` for its defaults
            (``explorer.space.DEFAULT_RANGES``).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, dummy_args: Optional[Dict[str, Any]] = None,
                 cluster: Optional[Cluster] = None, *, policies: Sequence[Callable[..., Any]] = (),
                 loss_fn: Optional[LossFn] = None, knobs: Optional[Knobs] = None,
                 recipe: Optional[Recipe] = None, optimizer_fn: Any = UNSET,
                 hardware: Optional[nbscaler.Hardware] = None, sweep_ranges: Optional[Dict[str, Any]] = None):
        if model is not None and dummy_args is None:
            raise ValueError("Explorer(model, dummy_args): give the model's forward arguments too, "
                             "e.g. Explorer(model, {'x': torch.randn(8, 16)}).")
        self._user_spec = user_model(model, dummy_args, loss_fn) if model is not None else None
        self.cluster = cluster
        self._owns_cluster = False                 # True once this Explorer started the cluster itself
        self.recipe = (Recipe.of(recipe, optimizer=optimizer_fn) if recipe is not None
                       else EXPLORER_RECIPE.replace(optimizer=optimizer_fn) if optimizer_fn is not UNSET
                       else EXPLORER_RECIPE)
        self.optimizer_fn = self.recipe.optimizer
        self.controls = Controls(knobs or Knobs(), policies, user_model=model is not None)
        self.controls.on_knobs, self.controls.on_model = self._knobs_changed, self._model_changed
        self.controls.compile_button.on_click(lambda _: self.compile())
        self.controls.train_button.on_click(lambda _: self.train())
        self.controls.compare_button.on_click(lambda _: self.compare())
        self.spec: ModelSpec = self._make_spec()
        self._fit_controls()
        self.compiled: Optional[Plan] = None       # the last plan from a trace (Compile)
        self.plan: Optional[Plan] = None           # the plan the knobs describe now (a re-placement of it)
        self.knob_latency_s: Optional[float] = None
        self.error: Optional[str] = None           # the first line of the last failure shown, if any
        self.last_exception: Optional[BaseException] = None
        self.comparison: Optional[Comparison] = None
        self._runs: List[Run] = []
        self._gen_dir = tempfile.TemporaryDirectory(prefix="nbscaler-explorer-")
        self.panes = Panes(view_options(self.recipe, hardware))
        self.losses = LossCurve()
        self.space = SpaceTab(self._say, self._reporting, self._space_picked, ranges=sweep_ranges)
        self.space.sweep_button.on_click(lambda _: self.sweep())
        self._build_layout()

    # -- what the user sees ---------------------------------------------------------------------
    def _build_layout(self) -> None:
        self.status = w.HTML(self._note("Choose a policy and knobs, then press <b>Compile</b>."))
        self.progress = w.IntProgress(value=0, min=0, max=1, description="", layout=w.Layout(width="300px",
                                                                                            visibility="hidden"))
        self.runs_table = w.HTML("<i>no runs yet</i>", layout=w.Layout(overflow="auto", flex="1 1 auto", width="0px"))
        self.compare_slot = w.VBox([w.HTML("<i>Pick two runs and press <b>Compare</b>.</i>")])
        self.tabs = w.Tab(children=[self.panes.slots[n] for n in TABS] + [self.compare_slot, self.space.widget],
                          titles=[str(n) for n in TABS] + ["compare", SPACE_TAB], layout=w.Layout(flex="1 1 auto"))
        charts = w.HBox([self.panes.slots[ViewName.TIMELINE], self.panes.slots[ViewName.MEMORY]])
        self.widget = w.VBox([
            w.HTML("<h3 style='margin:4px 0'>nbscaler Explorer</h3>"), w.HBox([self.status, self.progress]),
            w.HBox([self.controls.widget, self.tabs]), charts,
            w.HBox([self.losses.widget, self.runs_table])], layout=w.Layout(padding="6px"))
        self.widget.add_class("nbscaler-explorer")

    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        """The live widget, and for readers without a kernel the Explorer as it stands now
        (``snapshot_html``: knobs, charts as SVG, losses, runs)."""
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/html"] = snapshot_html(self)
        return bundle

    @property
    def runs(self) -> pd.DataFrame:
        """Every run of this Explorer: policy, knobs, compile s, step s, bubble, peak bytes per rank,
        and whether the losses matched one process (predicted columns end in ``_predicted``)."""
        return runs_frame(self._runs)

    def run(self, run_id: int) -> Run:
        """The run with this id (the index of ``runs``)."""
        for run in self._runs:
            if run.id == run_id:
                return run
        raise KeyError(f"no run {run_id}: the runs are {[r.id for r in self._runs]}")

    def set(self, **knobs: Any) -> None:
        """Turn knobs from code, as the controls do: ``set(policy='hybrid', plan_ngpus=4, stages=2)``."""
        with self._reporting("set knobs"):
            self.controls.set(**knobs)

    # -- the actions ----------------------------------------------------------------------------
    def compile(self) -> Optional[Plan]:
        """Trace, place and cost the model under the current knobs, and redraw every view."""
        with self._reporting("compile"), self._progress(2 + len(ViewName)) as step:
            knobs = self.controls.knobs(self.spec.end2end)
            config = knobs.compute_config()
            step(f"compiling {self.spec.label} under {knobs.policy_label} ...")
            plan = nbscaler.plan(self.spec.module, self.spec.dummy_args, knobs.policy, config)
            run = self._add_run(knobs, plan, plan.compile_seconds)
            step("costing memory and time ...")
            run.predicted                                   # noqa: B018 (the cost tables, computed once)
            self.compiled = self.plan = plan
            self.controls.show_plan(plan.config, plan.schedule)
            self.panes.show(plan, on_each=lambda name: step(f"drawing {name} ..."))
            self._say(f"Compiled run {run.id}: {knobs.policy_label} on {config.plan_ngpus} x {config.runtime_ngpus} "
                      f"devices in {plan.compile_seconds:.2f} s ({len(plan.graph)} ops).")
            return plan
        return None

    def train(self, steps: Optional[int] = None) -> Optional[Run]:
        """Train the current plan on the cluster, with live losses; then draw what was measured."""
        with self._reporting("train"):
            if steps is not None:
                self.controls.steps.value = steps
            if self.plan is None and self.compile() is None:
                return None
            plan, settings = self.plan, TrainSettings(self.controls.steps.value, self.controls.lr.value,
                                                      self.optimizer_fn)
            run = self._run_for(plan)
            cluster = self._cluster_for(plan.config.runtime_ngpus)
            self._say(f"Training run {run.id} on {cluster.world_size} ranks for {settings.steps} steps ...")
            self.losses.start(plan.config.runtime_ngpus, f"run {run.id}: loss per rank (live)")
            run.outcome = self._train_restarting(cluster, plan, settings, f"explorer_run{run.id}")
            self.losses.finish(run.outcome.result.steps, f"run {run.id}: loss per rank")
            self.panes.show(plan, PLACEMENT_VIEWS, measured=run.outcome.measured)
            self._refresh_runs()
            verdict = "match" if run.outcome.losses_match else "DO NOT match"
            compiled = run.outcome.torch_compile_s
            compiled = "" if compiled is None else f"; torch.compile took {compiled:.1f} s on the slowest rank"
            self._say(f"Trained run {run.id}: losses {verdict} one process (worst relative error "
                      f"{run.outcome.rel_err:.1e}); median step {run.outcome.step_s * 1e3:.0f} ms{compiled}.")
            return run
        return None

    def compare(self, a: Optional[int] = None, b: Optional[int] = None) -> Optional[Comparison]:
        """Runs ``a`` and ``b`` (default: the Compare pickers) side by side in every view."""
        with self._reporting("compare"):
            a = a if a is not None else self.controls.compare_a.value
            b = b if b is not None else self.controls.compare_b.value
            if a is None or b is None:
                raise ValueError("compare needs two runs: compile at least one first.")
            self.comparison = Comparison(self.run(a), self.run(b))
            self.compare_slot.children = [self.comparison.widget]
            self.tabs.selected_index = len(TABS)
            self._say(f"Comparing run {a} with run {b}.")
            return self.comparison
        return None

    def sweep(self) -> Optional[pd.DataFrame]:
        """Price every configuration of the model on the space tab's target (``nbscaler.sweep``)
        and draw them there; the tab's knobs re-price from then on."""
        with self._reporting("sweep"):
            self._say(f"Sweeping {self.spec.label}: tracing and placing its two-layer copy ...")
            self.space.build(self.spec.module, self.spec.dummy_args, self.recipe)
            self.tabs.selected_index = len(TABS) + 1
            return self.space.frame
        return None

    def close(self) -> None:
        """Stop the cluster this Explorer started (a given cluster is left running) and remove its files."""
        if self.cluster is not None and self._owns_cluster:
            self.cluster.stop()
        self._gen_dir.cleanup()

    # -- reacting to the controls -----------------------------------------------------------------
    def _knobs_changed(self) -> None:
        """Re-place the compiled graphs under the new knobs and redraw timeline and memory at once."""
        with self._reporting("re-place"):
            start = time.perf_counter()
            knobs = self.controls.knobs(self.spec.end2end)
            config = knobs.compute_config()
            if self.compiled is None:
                self._say("Knobs set. Press <b>Compile</b> to see the plan.")
                return
            plan = self.compiled.replan(knobs.policy, config)
            self.panes.show(plan, PLACEMENT_VIEWS)
            self.plan = plan
            self.controls.show_plan(plan.config, plan.schedule)
            self.knob_latency_s = time.perf_counter() - start
            self._say(f"Re-placed under {knobs.policy_label} on {config.plan_ngpus} x {config.runtime_ngpus} devices "
                      f"in {self.knob_latency_s * 1e3:.0f} ms: timeline, memory and why are current; graph, plan and "
                      "code show the last compile until you press <b>Compile</b>.")

    def _space_picked(self, row: pd.Series) -> None:
        """Plan the configuration of a space row (``hybrid``, its ``config_of``) and show it in every
        pane, the timeline and memory on the space's target with its master copies, and in the
        knobs (quietly: the plan is drawn already). The plan becomes the compiled one, so a knob
        turned next re-places its trace. A real-size model is planned as it is given: build it on
        the meta device, and nothing is allocated."""
        start = time.perf_counter()
        space = self.space.space
        args = one_sequence(space.dummy_args, int(row[SweepColumn.MICRO_BATCH]))
        plan = nbscaler.plan(self.spec.module, args, "hybrid", space.config(row), module_dtype=space.module_dtype)
        self.panes.retarget(view_options(space.recipe, space.hardware))
        self.panes.show(plan)
        self.compiled = self.plan = plan
        self.controls.show_plan(plan.config, plan.schedule, plan.policy_name,
                                loaded=f"<small>from the space tab: {html.escape(describe(row))}</small>")
        self._say(f"Loaded {describe(row)}; planned and drawn in {time.perf_counter() - start:.2f} s.")

    def _model_changed(self) -> None:
        with self._reporting("choose the model"):
            self.spec = self._make_spec()
            self._fit_controls()
            self.compiled = self.plan = None
            self._say(f"Model: {self.spec.label}. Press <b>Compile</b> to trace it.")

    def _fit_controls(self) -> None:
        """Offer the knobs that apply to the model: the recompute knob recomputes its repeated
        layers (the stack a sweep reads its depth from), where it has some."""
        try:
            layers = (find_stack(self.spec.module).path,)
        except ValueError:
            layers = ()
        self.controls.fit_model(self.spec.end2end, layers)

    def _make_spec(self) -> ModelSpec:
        if self.controls.model.value == SHIPPED_GPT or self._user_spec is None:
            return shipped_gpt(n_layer=self.controls.n_layer.value)
        return self._user_spec

    # -- runs and the cluster ---------------------------------------------------------------------
    def _add_run(self, knobs: Knobs, plan: Plan, compile_s: float) -> Run:
        run = Run(len(self._runs) + 1, self.spec.label, knobs, plan, compile_s, self.optimizer_fn, self.recipe)
        self._runs.append(run)
        self._refresh_runs()
        return run

    def _run_for(self, plan: Plan) -> Run:
        """The untrained run of this plan, or a new run (a re-placed plan, or one trained before)."""
        last = self._runs[-1] if self._runs else None
        if last is not None and last.plan is plan and last.outcome is None:
            return last
        return self._add_run(self.controls.knobs(self.spec.end2end), plan, plan.compile_seconds)

    def _train_restarting(self, cluster: Cluster, plan: Plan, settings: TrainSettings, name: str) -> TrainOutcome:
        """Train; a cluster that refuses calls (an engine died, or a rank would not stop after an
        earlier failure) is restarted once, as its error asks, and the run goes on."""
        try:
            return train_on_cluster(cluster, self.spec, plan, settings, self._gen_dir.name, name,
                                    on_report=self.losses.on_report)
        except ClusterError as e:
            self._say(f"Restarting the engines ({html.escape(str(e).split(';')[0])}) ...")
            cluster.restart()
            return train_on_cluster(cluster, self.spec, plan, settings, self._gen_dir.name, name,
                                    on_report=self.losses.on_report)

    def _refresh_runs(self) -> None:
        self.runs_table.value = self.runs.to_html(classes="nbscaler-runs", float_format=lambda v: f"{v:.3g}")
        self.controls.set_runs([run.id for run in self._runs])

    def _cluster_for(self, nranks: int) -> Cluster:
        """The given cluster, or one this Explorer starts (again, when the rank count changed or an
        engine died)."""
        if self.cluster is not None and not self._owns_cluster:
            return self.cluster
        if self.cluster is None or self.cluster.world_size != nranks or not self.cluster.running:
            self._say(f"Starting {nranks} engines ...")
            self.cluster, self._owns_cluster = Cluster(n=nranks, name="nbscaler-explorer"), True
        return self.cluster

    # -- messages -----------------------------------------------------------------------------------
    @staticmethod
    def _note(text: str, kind: str = "info") -> str:
        colour = {"info": "#1f4e79", "error": "#a31515"}[kind]
        return f"<div class='nbscaler-status nbscaler-{kind}' style='color:{colour}'>{text}</div>"

    def _say(self, text: str) -> None:
        self.error = None
        self.status.value = self._note(text)

    @contextlib.contextmanager
    def _reporting(self, action: str) -> Iterator[None]:
        """Show any exception of ``action`` in the widget instead of raising it."""
        try:
            yield
        except Exception as e:                      # noqa: BLE001 (every failure becomes a message)
            self.last_exception = e
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.status.value = self._note(_error_html(action, e), "error")

    @contextlib.contextmanager
    def _progress(self, total: int) -> Iterator[Callable[[str], None]]:
        """A progress bar over ``total`` steps; the yielded ``step(text)`` advances it."""
        self.progress.max, self.progress.value, self.progress.layout.visibility = total, 0, "visible"

        def step(text: str) -> None:
            self.progress.value = min(self.progress.value + 1, total)
            self.status.value = self._note(text)

        try:
            yield step
        finally:
            self.progress.layout.visibility = "hidden"


def _error_html(action: str, e: Exception) -> str:
    """A readable error: what failed and the exception's message; a rank's traceback folded away."""
    message = html.escape(str(e)).split("--- traceback", 1)[0].strip().replace("\n", "<br>")
    text = f"<b>Could not {action}.</b> {type(e).__name__}: {message}"
    if isinstance(e, RankError) and e.remote_traceback:
        text += f"<details><summary>traceback on rank {e.rank}</summary><pre>{html.escape(e.remote_traceback)}</pre></details>"
    return text
