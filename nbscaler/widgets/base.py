"""The contract every view follows, and the measured data a view may draw beside the plan.

A view is built from one :class:`~nbscaler.planning.Plan`. It owns a live ``widget`` (an anywidget,
a plotly ``FigureWidget`` or an ipywidgets box) that ``update`` redraws in place, and it renders
itself as a self-contained HTML fragment (``to_html``) so that a saved notebook, nbviewer, GitHub and
``nbscaler report`` show it without a kernel. Views never recompute what the plan already gives
(``plan.ops``, ``plan.collectives``, ``plan.summary()``, ``plan.memory()``, ``plan.timeline()``,
``plan.sources``); they read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import pandas as pd

if TYPE_CHECKING:                      # views import the planner lazily: types only
    import ipywidgets

    from nbscaler.planning import Plan
    from nbscaler.planning.fingerprint import Fingerprint


@dataclass
class Measured:
    """What a run measured, as DataFrames with the same column names as the predicted tables.

    - ``timeline``: rows ``(rank, stage, micro, phase, t_start, t_end)``, from
      ``ParallelModule.pipeline_timeline()`` or the cluster's telemetry;
    - ``memory``: one row per rank with ``nbscaler.columns.MEMORY_COLUMNS``
      (``nbscaler.runtime.memory``);
    - ``losses``: one row per (step, rank) loss of the run.
    Any of them may be ``None``: a view draws what there is.
    """

    timeline: Optional[pd.DataFrame] = None
    memory: Optional[pd.DataFrame] = None
    losses: Optional[pd.DataFrame] = None

    def __bool__(self) -> bool:
        return any(f is not None for f in (self.timeline, self.memory, self.losses))

    @classmethod
    def from_train_result(cls, result: Any) -> "Measured":
        """From a cluster's ``TrainResult``: its pipeline blocks (all steps; views draw the last),
        its memory rows and its losses."""
        schedule = result.schedule
        return cls(timeline=schedule if schedule is not None and len(schedule) else None,
                   memory=result.memory, losses=result.steps[["step", "rank", "loss"]])

    def save(self, folder: Union[str, Path]) -> Path:
        """Write each frame there is as ``<name>.csv`` in ``folder`` (each file atomically), so
        ``nbscaler report`` can show the run later; returns the folder."""
        from nbscaler.genfiles import atomic_write_bytes

        folder = Path(folder)
        for f in fields(self):
            frame = getattr(self, f.name)
            if frame is not None:
                atomic_write_bytes(folder / f"{f.name}.csv", frame.to_csv(index=False).encode())
        return folder

    @classmethod
    def load(cls, folder: Union[str, Path]) -> "Measured":
        """What ``save`` wrote (missing files are ``None``)."""
        folder = Path(folder)
        return cls(**{f.name: pd.read_csv(folder / f"{f.name}.csv") if (folder / f"{f.name}.csv").exists() else None
                      for f in fields(cls)})


class View:
    """A view over one Plan (and optionally measured data from a run).

    Subclasses either set ``self.widget`` in ``__init__`` or build it on first use in
    ``_build_widget`` (a plotly ``FigureWidget`` costs seconds the first time in a process, and a
    report never needs one); they implement ``_redraw`` (refresh the view from ``self.plan`` and
    ``self.measured``) and ``to_html``.
    """

    _widget: Optional["ipywidgets.DOMWidget"] = None

    @property
    def widget(self) -> "ipywidgets.DOMWidget":
        """The live widget (an anywidget, a plotly ``FigureWidget`` or an ipywidgets box)."""
        if self._widget is None:
            self._widget = self._build_widget()
        return self._widget

    @widget.setter
    def widget(self, value: "ipywidgets.DOMWidget") -> None:
        self._widget = value

    def _build_widget(self) -> "ipywidgets.DOMWidget":
        raise NotImplementedError(f"{type(self).__name__} must set self.widget or implement _build_widget")

    def __init__(self, plan: "Plan", *, measured: Optional[Measured] = None, **options: Any) -> None:
        self.plan = plan
        self.measured = measured if measured is not None else Measured()
        self.options = options

    def update(self, plan: Optional["Plan"] = None, *, measured: Optional[Measured] = None) -> None:
        """Redraw in place for a new plan and/or measured data (the Explorer calls this).

        A new plan without new measured data drops the old measurements: they belong to the old plan.
        """
        if plan is not None and plan is not self.plan:
            self.plan = plan
            self.measured = measured if measured is not None else Measured()
        elif measured is not None:
            self.measured = measured
        self._redraw()

    def _redraw(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _redraw")

    def to_html(self) -> str:
        """A self-contained HTML fragment (inline CSS/JS/SVG, no network, no kernel)."""
        raise NotImplementedError(f"{type(self).__name__} must implement to_html")

    def notebook_html(self) -> str:
        """The ``text/html`` a notebook saves: ``to_html()`` unless a view has a lighter form that
        needs no script (the chart views draw SVG; ``nbscaler.widgets.plotting.ChartView``)."""
        return self.to_html()

    def fingerprint(self) -> Optional["Fingerprint"]:
        """The plan tables this view shows, which its saved output is checked by against a fresh run
        (``nbscaler.planning.fingerprint``); ``None`` for a view that shows none (the timeline
        draws seconds only)."""
        return None

    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        """The widget's own bundle (live in Jupyter), ``text/html`` = ``notebook_html()`` (saved
        notebooks, GitHub, nbviewer) and the ``fingerprint()`` of what it shows."""
        from nbscaler.planning.fingerprint import bundle as fingerprint_entry

        bundle: Dict[str, Any] = {}
        own = getattr(self.widget, "_repr_mimebundle_", None)
        if own is not None:
            got = own(**kwargs)
            data = got[0] if isinstance(got, tuple) else got
            bundle.update(data or {})
        bundle["text/html"] = self.notebook_html()
        bundle.setdefault("text/plain", repr(self))
        bundle.update(fingerprint_entry(self.fingerprint()))
        return bundle

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plan!r})"
