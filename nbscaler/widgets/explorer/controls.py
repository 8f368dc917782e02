"""The Explorer's controls: ipywidgets for the model, the policy and the compute knobs.

``Controls`` owns the widgets and nothing else. It reads them back as a ``Knobs`` record, sets them
from code (``set(policy='pp', stages=2)``, one notification for the lot), and calls the Explorer's
handlers when a knob or the model changes or a button is pressed. Which values are allowed is
decided by ``Knobs.compute_config()`` and the planner, not here: a bad combination is reported by
the Explorer, with the planner's message.

The knobs tell the truth: after a compile, a re-placement or a plan loaded from the space tab
``show_plan`` sets them to the plan's own configuration (a ``pp`` plan staged over every device reads
its stage count, not the 1 that asked for it; a space row reads ``hybrid`` on its devices, stages,
micro-batches, ZeRO stage and recompute), and a knob that does not apply is hidden (GPT layers for
your own module) or disabled (micro-batches and scheduler without a pipeline; every pipeline knob
for a module that is not end2end; sequence, context and expert parallel for a policy that does not
read them; the ZeRO stage without ZeRO).

The recompute knob is a granularity (``RecomputeGranularity``): ``none``, ``selective`` (each
attention core, ``pas_config['recompute'] = 'selective'``) or ``full`` (each of the model's repeated
layers, named as ``pas_config['recompute_modules']``, as the space tab plans it); a module without
repeated layers is not offered ``full``.
"""

from __future__ import annotations

import contextlib
import html
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import ipywidgets as w

from nbscaler.config import TRAIN_SCHEDULERS, ZERO_STAGES, ComputeConfig, RecomputeGranularity
from nbscaler.layouts import ContextKind
from nbscaler.policy.builtin import PIPELINE_POLICIES, SEQUENCE_PARALLEL
from nbscaler.policy.context import CONTEXT_PARALLEL, CONTEXT_PARALLEL_KIND
from nbscaler.policy.experts import expert_parallel, expert_tensor_parallel_size
from nbscaler.schedule import PipelineSchedule
from nbscaler.widgets.explorer.knobs import BuiltinPolicy, Knobs, Policy, recompute_of

DEVICE_CHOICES = [1, 2, 4, 8]
SHIPPED_GPT = "GPT (nbscaler.models)"
USER_MODEL = "your module"
RECOMPUTE_CHOICES = [g.value for g in RecomputeGranularity]
CONTEXT_KINDS = [k.value for k in ContextKind]
KNOB_NAMES = ("policy", "plan_ngpus", "runtime_ngpus", "stages", "nmicros", "scheduler", "use_zero", "zero_stage",
              "zero_reshard_after_forward", "recompute", "sequence_parallel", "context_parallel",
              "context_parallel_kind", "expert_parallel", "expert_tensor_parallel", "torch_compile")


def _label() -> Dict[str, Any]:
    """A labelled control's style, with a layout of its own (hiding one hides no other)."""
    return {"style": {"description_width": "120px"}, "layout": w.Layout(width="280px")}


class Controls:
    """The control panel; ``on_knobs``, ``on_model`` and the button handlers are set by the owner."""

    def __init__(self, knobs: Knobs, policies: Sequence[Policy] = (), user_model: bool = False):
        self._policies: Dict[str, Policy] = {str(p): str(p) for p in BuiltinPolicy}
        self._policies.update({getattr(p, "__name__", repr(p)): p for p in policies})
        self.on_knobs: Callable[[], None] = lambda: None
        self.on_model: Callable[[], None] = lambda: None
        self._held = False

        self.model = w.Dropdown(options=[SHIPPED_GPT] + ([USER_MODEL] if user_model else []),
                                value=USER_MODEL if user_model else SHIPPED_GPT, description="model", **_label())
        self.n_layer = w.BoundedIntText(value=2, min=1, max=48, description="GPT layers", **_label())
        self.policy = w.Dropdown(options=list(self._policies), value=knobs.policy_label, description="policy",
                                 **_label())
        self.plan_ngpus = w.Dropdown(options=DEVICE_CHOICES, value=knobs.plan_ngpus, description="plan devices",
                                     **_label())
        self.runtime_ngpus = w.Dropdown(options=DEVICE_CHOICES, value=knobs.runtime_ngpus,
                                        description="runtime devices", **_label())
        self.stages = w.Dropdown(options=[1, 2, 4, 8], value=knobs.stages, description="pipeline stages", **_label())
        self.nmicros = w.BoundedIntText(value=knobs.nmicros, min=1, max=64, description="micro-batches", **_label())
        self.scheduler = w.Dropdown(options=list(TRAIN_SCHEDULERS), value=knobs.scheduler, description="scheduler",
                                    **_label())
        self.use_zero = w.Checkbox(value=knobs.use_zero, description="ZeRO", indent=False)
        self.zero_stage = w.Dropdown(options=list(ZERO_STAGES), value=knobs.zero_stage, description="ZeRO stage",
                                     **_label())
        self.zero_reshard_after_forward = w.Checkbox(value=knobs.zero_reshard_after_forward, indent=False,
                                                     description="free units after their forward")
        self.recompute = w.Dropdown(options=RECOMPUTE_CHOICES, value=knobs.recompute, description="recompute",
                                    **_label())
        self._recompute_modules: Tuple[str, ...] = knobs.recompute_modules   # what recompute 'full' recomputes
        self.loaded = w.HTML("")             # where the plan shown came from, when not from these knobs
        self.sequence_parallel = w.Checkbox(value=knobs.sequence_parallel, description="sequence parallel",
                                            indent=False)
        self.context_parallel = w.Dropdown(options=DEVICE_CHOICES, value=knobs.context_parallel,
                                           description="context parallel", **_label())
        self.context_parallel_kind = w.Dropdown(options=CONTEXT_KINDS, value=knobs.context_parallel_kind,
                                                description="context kind", **_label())
        self.expert_parallel = w.Dropdown(options=DEVICE_CHOICES, value=knobs.expert_parallel,
                                          description="expert parallel", **_label())
        self.expert_tensor_parallel = w.Dropdown(options=DEVICE_CHOICES, value=knobs.expert_tensor_parallel,
                                                 description="expert groups of", **_label())
        self.torch_compile = w.Checkbox(value=knobs.torch_compile, description="torch.compile the ranks",
                                        indent=False)
        self.steps = w.BoundedIntText(value=5, min=1, max=10_000, description="train steps", **_label())
        self.lr = w.FloatText(value=0.05, description="learning rate", **_label())

        self.compile_button = w.Button(description="Compile", button_style="primary", icon="cogs")
        self.train_button = w.Button(description="Train on the cluster", button_style="success", icon="play")
        self.compare_a = w.Dropdown(options=[], description="compare", layout=w.Layout(width="150px"),
                                    style={"description_width": "60px"})
        self.compare_b = w.Dropdown(options=[], description="with", layout=w.Layout(width="130px"),
                                    style={"description_width": "40px"})
        self.compare_button = w.Button(description="Compare", icon="columns")
        for button in (self.compile_button, self.train_button, self.compare_button):
            button.layout.width = "280px"
            button.add_class(f"nbscaler-{button.description.split()[0].lower()}")

        self._end2end = True
        self._show_applicable()
        for name in KNOB_NAMES:
            getattr(self, name).observe(self._knob_changed, names="value")
        for widget in (self.model, self.n_layer):
            widget.observe(self._model_changed, names="value")
        self.widget = w.VBox([
            w.HTML("<b>Model</b>"), self.model, self.n_layer,
            w.HTML("<b>Policy and compute</b>"), self.loaded, self.policy, self.plan_ngpus, self.runtime_ngpus,
            self.stages, self.nmicros, self.scheduler, self.use_zero, self.zero_stage,
            self.zero_reshard_after_forward, self.recompute, self.sequence_parallel, self.context_parallel,
            self.context_parallel_kind, self.expert_parallel, self.expert_tensor_parallel, self.torch_compile,
            self.compile_button,
            w.HTML("<b>Train</b>"), self.steps, self.lr, self.train_button,
            w.HTML("<b>Runs</b>"), w.HBox([self.compare_a, self.compare_b]), self.compare_button,
        ], layout=w.Layout(width="300px", min_width="300px"))
        self.widget.add_class("nbscaler-controls")

    # -- reading and setting --------------------------------------------------------------------
    def knobs(self, end2end: bool = True) -> Knobs:
        """The knobs as the widgets show them."""
        return Knobs(policy=self._policies[self.policy.value], plan_ngpus=self.plan_ngpus.value,
                     runtime_ngpus=self.runtime_ngpus.value, stages=self.stages.value, nmicros=self.nmicros.value,
                     scheduler=self.scheduler.value, use_zero=self.use_zero.value, zero_stage=self.zero_stage.value,
                     zero_reshard_after_forward=self.zero_reshard_after_forward.value, recompute=self.recompute.value,
                     recompute_modules=self._recompute_modules, end2end=end2end,
                     sequence_parallel=self.sequence_parallel.value, context_parallel=self.context_parallel.value,
                     context_parallel_kind=self.context_parallel_kind.value, torch_compile=self.torch_compile.value,
                     expert_parallel=self.expert_parallel.value,
                     expert_tensor_parallel=self.expert_tensor_parallel.value)

    def set(self, **values: Any) -> None:
        """Set knobs from code (``set(policy='pp', stages=2)``); the owner hears one change at the end."""
        unknown = set(values) - set(KNOB_NAMES) - {"n_layer", "steps", "lr", "model"}
        if unknown:
            raise ValueError(f"unknown knob(s) {', '.join(sorted(unknown))}: use {', '.join(KNOB_NAMES)}, "
                             "n_layer, steps, lr or model.")
        if isinstance(values.get("recompute"), bool):     # the knob was a checkbox of the repeated layers
            values["recompute"] = RecomputeGranularity.FULL if values["recompute"] else RecomputeGranularity.NONE
        if "recompute" in values:
            values["recompute"] = str(values["recompute"])
        with self._hold():                   # the policy first: leaving a pipeline policy resets the stages
            for name in sorted(values, key=lambda name: name != "policy"):
                getattr(self, name).value = values[name]
        if set(values) & {"model", "n_layer"}:
            self.on_model()
        if set(values) & set(KNOB_NAMES):
            self.on_knobs()

    def show_plan(self, config: ComputeConfig, schedule: Optional[PipelineSchedule], policy: Optional[str] = None,
                  loaded: str = "") -> None:
        """Set the knobs to what a plan runs under, quietly (the plan is already on screen): no
        ``on_knobs``, so nothing is placed again.

        The stage count is the plan's pipeline devices, the ``pipeline_nstages`` that rebuilds it
        (``1f1b_plus`` runs one more stage, its shared head, on the same devices). ``policy``, when
        the controls offer it, is set too (a plan loaded from elsewhere ran under its own); a device
        count beyond the usual choices (16 GPUs of two nodes) is offered. ``loaded`` says where the
        plan came from, above the knobs, until a knob turns or the next compile.
        """
        recompute, modules = recompute_of(config)
        with self._hold():
            if policy in self._policies:
                self.policy.value = policy
            for knob, value in ((self.plan_ngpus, config.plan_ngpus), (self.runtime_ngpus, config.runtime_ngpus),
                                (self.stages, schedule.ndevices if schedule is not None else 1)):
                if value not in knob.options:
                    knob.options = sorted({*knob.options, value})
                knob.value = value
            self.use_zero.value = config.use_zero
            self.zero_stage.value = config.zero_stage
            self.zero_reshard_after_forward.value = config.zero_reshard_after_forward
            if recompute not in self.recompute.options:     # named modules of a model without a stack
                self.recompute.options = RECOMPUTE_CHOICES
            self.recompute.value = recompute
            self._recompute_modules = modules or self._recompute_modules
            self.sequence_parallel.value = bool(config.pas_config.get(SEQUENCE_PARALLEL, False))
            self.torch_compile.value = config.compile
            cp = int(config.pas_config.get(CONTEXT_PARALLEL, 1))
            if cp not in self.context_parallel.options:
                self.context_parallel.options = sorted({*self.context_parallel.options, cp})
            self.context_parallel.value = cp
            if cp > 1:
                self.context_parallel_kind.value = str(config.pas_config.get(CONTEXT_PARALLEL_KIND, CONTEXT_KINDS[0]))
            ep = expert_parallel(config)
            if ep not in self.expert_parallel.options:
                self.expert_parallel.options = sorted({*self.expert_parallel.options, ep})
            self.expert_parallel.value = ep
            etp = expert_tensor_parallel_size(config)
            if etp not in self.expert_tensor_parallel.options:
                self.expert_tensor_parallel.options = sorted({*self.expert_tensor_parallel.options, etp})
            self.expert_tensor_parallel.value = etp
            if schedule is not None:
                self.nmicros.value, self.scheduler.value = config.pipeline_nmicros, config.scheduler
        self.loaded.value = loaded
        self._show_applicable()

    def fit_model(self, end2end: bool, recompute_modules: Tuple[str, ...] = ()) -> None:
        """Enable the knobs that apply to the chosen model (pipelines need an end2end one; recompute
        ``full`` recomputes ``recompute_modules``, its repeated layers, and is offered only where
        there are some)."""
        self._end2end = end2end
        self._recompute_modules = tuple(recompute_modules)
        offered = [g for g in RECOMPUTE_CHOICES if recompute_modules or g != RecomputeGranularity.FULL]
        with self._hold():
            if list(self.recompute.options) != offered:
                kept = self.recompute.value if self.recompute.value in offered else RecomputeGranularity.NONE.value
                self.recompute.options = offered
                self.recompute.value = kept
        self._show_applicable()

    def _show_applicable(self) -> None:
        gpt = self.model.value == SHIPPED_GPT
        self.n_layer.disabled = not gpt
        self.n_layer.layout.display = None if gpt else "none"
        self.stages.disabled = not self._end2end
        pipelined = self._end2end and self.knobs(self._end2end).pipelined
        self.nmicros.disabled = self.scheduler.disabled = not pipelined
        self.sequence_parallel.disabled = not self.knobs(self._end2end).sequence_parallel_applies
        self.context_parallel.disabled = not self.knobs(self._end2end).context_parallel_applies
        self.context_parallel_kind.disabled = self.knobs(self._end2end).context_parallel_size == 1
        self.expert_parallel.disabled = not self.knobs(self._end2end).expert_parallel_applies
        self.expert_tensor_parallel.disabled = self.knobs(self._end2end).expert_parallel_size == 1
        self.zero_stage.disabled = not self.use_zero.value
        self.zero_reshard_after_forward.disabled = not (self.use_zero.value and self.zero_stage.value == 3)

    def as_table(self) -> str:
        """The model and the knobs as the controls show them, as an HTML table (for the saved
        form of the Explorer); a knob that does not apply reads ``n/a``."""
        shown = [self.model, self.n_layer, self.policy, self.plan_ngpus, self.runtime_ngpus, self.stages,
                 self.nmicros, self.scheduler, self.use_zero, self.zero_stage, self.zero_reshard_after_forward,
                 self.recompute, self.sequence_parallel, self.context_parallel, self.context_parallel_kind,
                 self.expert_parallel, self.expert_tensor_parallel, self.torch_compile]
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(c.description)}</th>"
                       f"<td>{'n/a' if c.disabled else html.escape(str(c.value))}</td></tr>"
                       for c in shown if c.layout.display != "none")
        return f"<table class='nbscaler-knobs' style='border-collapse:collapse;font-size:13px'>{rows}</table>"

    def set_runs(self, run_ids: List[int]) -> None:
        """Offer these runs to the Compare pickers; preselect the last two."""
        for picker in (self.compare_a, self.compare_b):
            picker.options = run_ids
        if run_ids:
            self.compare_a.value = run_ids[-2] if len(run_ids) > 1 else run_ids[-1]
            self.compare_b.value = run_ids[-1]

    @contextlib.contextmanager
    def _hold(self) -> Iterator[None]:
        held, self._held = self._held, True
        try:
            yield
        finally:
            self._held = held

    def _knob_changed(self, change: Dict[str, Any]) -> None:
        if change["owner"] is self.policy and change["old"] in PIPELINE_POLICIES \
                and change["new"] not in PIPELINE_POLICIES:
            with self._hold():               # the pipeline's stages were the policy's, not the user's
                self.stages.value = 1
        self._show_applicable()
        if not self._held:
            self.loaded.value = ""           # the plan is the knobs' own from here
            self.on_knobs()

    def _model_changed(self, change: Dict[str, Any]) -> None:
        self._show_applicable()
        if not self._held:
            self.on_model()
