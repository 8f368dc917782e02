"""The configuration objects of the public API.

``ComputeConfig`` says how many devices one copy of the model is spread over (``plan_ngpus``), how
many run in total (``runtime_ngpus``), and which code-generation features are on.  It checks itself
when it is built, so a wrong setting fails at once with a message that names the field and the fix,
instead of deep inside code generation or, worse, as a hang at run time.

>>> cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4)
>>> cfg.units            # data-parallel copies of the 2-device plan
2
>>> cfg.grid.dp_ranks(1)  # every question of which ranks goes to its rank grid
(1, 3)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from nbscaler.columns import StrEnum
from nbscaler.schedule.geometry import PipelineGeometry
from nbscaler.schedule.grid import RankGrid
from nbscaler.schedule.schedulers import SCHEDULERS, scheduler_spec

TRAIN_SCHEDULERS = tuple(name for name, spec in SCHEDULERS.items() if spec.training)
INFER_SCHEDULERS = tuple(name for name, spec in SCHEDULERS.items() if not spec.training)
#: The ``pas_config`` key naming the modules to recompute in the backward (``nbscaler.policy.recompute``).
RECOMPUTE_MODULES = "recompute_modules"
#: The ``pas_config`` key choosing how much of each layer to recompute (``RecomputeGranularity``).
RECOMPUTE = "recompute"
#: The ``pas_config`` key of context parallelism: the devices a stage's sequence is split over
#: (``nbscaler.policy.context``).
CONTEXT_PARALLEL = "context_parallel"
PIPELINE_KEYS = ("use_pipeline", "pipeline_nmicros", "pipeline_nstages", "pipeline_scheduler",
                 "pipeline_virtual_stages")
ZERO_STAGES = (1, 2, 3)
#: What ZeRO stage 3 shards each unit of (``ComputeConfig.zero_units``) by default: each repeated layer.
ZERO_UNITS_DEFAULT: Tuple[str, ...] = ()
#: ``torch.compile``'s backend unless ``ComputeConfig.compile_backend`` names another: it runs on CPUs and GPUs.
DEFAULT_COMPILE_BACKEND = "inductor"


def threads_per_rank(cores: int, ranks_on_host: int) -> int:
    """The intra-op threads of each rank on a host: its share of the cores, so that ranks do not
    fight over them. ``runtime.launch.spawn``, the cluster's engines and the time model (which
    profiles ops at that thread count) all ask this.

    >>> threads_per_rank(8, 4), threads_per_rank(2, 4)
    (2, 1)
    """
    return max(1, cores // max(1, ranks_on_host))


class RecomputeGranularity(StrEnum):
    """What ``pas_config={'recompute': ...}`` recomputes in the backward (Megatron-LM's
    ``--recompute-granularity``; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models"):

    - ``none``: nothing; every op keeps what it saves;
    - ``selective``: the attention core of each layer only (the scores Q·Kᵀ, their scale and mask,
      the softmax, the attention dropout and the product with V, or one
      ``scaled_dot_product_attention``): the tensors of size sequence², cheap to compute again;
    - ``full``: each layer of the model's repeated layers, whole: each keeps only its input.

    ``nbscaler.policy.recompute`` finds the regions; ``recompute_modules`` names modules instead.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class ReuseType(str, Enum):
    """What ``parallelize`` may take from an earlier run in the same ``gen_savedir``.

    - ``match``: reuse when the saved config equals this one, raise when it differs, generate when
      nothing is there.
    - ``override``: regenerate everything.
    - ``moo`` (match or override): reuse when equal, regenerate otherwise.
    - ``graph``: reuse only the traced graph when it matches, regenerate the plan and the code.
    """

    MATCH = "match"
    OVERRIDE = "override"
    MOO = "moo"
    GRAPH = "graph"


class BroadcastGenFilesStrategy(str, Enum):
    """Which newly generated files rank 0 sends to the other ranks (reused files are never sent).

    - ``none``: nothing; the files are on a shared disk, or the user copies them.
    - ``all``: code, config, graph and initial weights.
    - ``no_weights``: everything but the initial weights; load with ``init_module_params=False``
      where there are no weights and call ``broadcast_weights`` afterwards.
    - ``code``: the generated code only.
    """

    NONE = "none"
    ALL = "all"
    NO_WEIGHTS = "no_weights"
    CODE = "code"


@dataclass
class UserConfig:
    """Free-form user settings that decide reuse.

    A change in ``graph`` forces a new trace; a change in ``code`` forces new code generation.
    """

    graph: Dict[str, Any] = field(default_factory=dict)
    code: Dict[str, Any] = field(default_factory=dict)


def check_float_dtype(name: str, value: Any) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a floating-point ``torch.dtype`` or ``None``."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{name}={value!r} is invalid: give a floating-point torch.dtype such as "
                         "torch.float32 or torch.bfloat16, or None.")


DEFAULT_BUCKET_BYTES = 25 * 2**20
"""The default ``ComputeConfig.reduce_bucket_bytes``: 25 MiB, DDP's ``bucket_cap_mb``."""


def split_buckets(sizes: Sequence[Tuple[int, torch.dtype]], bucket_bytes: int) -> List[List[int]]:
    """The gradient buckets of parameters of ``(nbytes, dtype)`` in order, as index lists: runs of
    consecutive parameters of one dtype, a new bucket started where the next parameter would take
    the current one past ``bucket_bytes`` (a parameter larger than that is a bucket of its own).
    The reducers and the memory and time models all bucket by this one rule.

    >>> split_buckets([(4, torch.float32), (4, torch.float32), (4, torch.float32)], 8)
    [[0, 1], [2]]
    """
    return [list(run) for run in _split(tuple(sizes), bucket_bytes)]


@functools.lru_cache(maxsize=4096)
def _split(sizes: Tuple[Tuple[int, torch.dtype], ...], bucket_bytes: int) -> Tuple[Tuple[int, ...], ...]:
    """``split_buckets``, once per parameter list: a sweep buckets the same devices' parameters for
    each configuration's time, memory and gradients."""
    out: List[List[int]] = []
    size = 0
    for index, (nbytes, dtype) in enumerate(sizes):
        if out and (size + nbytes > bucket_bytes or dtype != sizes[out[-1][0]][1]):
            out.append([])
            size = 0
        if not out:
            out.append([])
        out[-1].append(index)
        size += nbytes
    return tuple(tuple(run) for run in out)


_WORDS = {2: "two", 3: "three"}


def _fail(field_name: str, value: Any, fix: str) -> None:
    raise ValueError(f"ComputeConfig.{field_name}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class ComputeConfig:
    """Where and how the parallel module runs.

    Ranks ``r`` and ``r'`` are in the same *unit* when ``r // plan_ngpus == r' // plan_ngpus``;
    a unit holds one whole copy of the model, split over its ``plan_ngpus`` devices. Units are
    data-parallel copies of each other and their gradients are summed.

    The pipeline settings may be given as fields or as ``pas_config`` keys of the same names; after
    construction the fields hold the effective values.

    ``pipeline_virtual_stages`` says how many stages each pipeline device holds under a scheduler
    that takes any number (``1f1b_interleaved``): ``pipeline_nstages // pipeline_virtual_stages``
    pipeline devices, each a group of ``plan_ngpus // devices`` plan devices that the ``hybrid``
    policy makes tensor-parallel (Megatron-LM's virtual pipeline stages). Unset (``-1``), every plan
    device is a pipeline device; the other schedulers fix it themselves (``zbv``: 2, the others 1).

    >>> cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
    ...                     pipeline_nstages=4, pipeline_virtual_stages=2, pipeline_nmicros=4)
    >>> cfg.grid.pipeline.tp, cfg.grid.stage_group(1)      # 2 pipeline devices x 2-way tensor parallelism
    (2, (2, 3))

    ZeRO (``use_zero=True``) splits state over the data-parallel ranks of each plan device, in
    ``zero_ngroups`` groups; under context parallelism over the devices of each context-parallel
    group as well, which hold the same weights (``RankGrid.zero_over_stage``). ``zero_stage=1``
    (the default) splits the optimizer state: the full gradients live until the optimizer step,
    which reduce-scatters them and frees them.
    ``zero_stage=2`` splits the gradients as well: each bucket of gradients is reduce-scattered
    and freed as soon as the backward has produced it, so a rank holds at once the full gradients
    of the buckets the backward is producing only. ``zero_stage=3`` (fully sharded data parallelism,
    as FSDP) shards the parameters too: each rank stores ``1/N`` of every *unit* (by default each
    repeated layer of the model, and one unit for the rest; ``zero_units`` names module paths or
    classes instead), all-gathers a unit's parameters just before its forward and frees them after
    it (``zero_reshard_after_forward=False`` keeps them until the backward, as Llama 3 trained),
    gathers them again for the backward, and reduce-scatters the unit's gradients as soon as they
    are made. ``nbscaler.runtime.fsdp`` says how.

    ``reduce_bucket_bytes`` (default 25 MiB, as DDP's ``bucket_cap_mb``) caps a gradient bucket:
    gradients are packed, cast to the reduction dtype and summed one bucket at a time, so the packed
    copy (fp32 for a bf16 model) never holds more than one bucket, and under ZeRO stage 2 a bucket
    is reduce-scattered and freed as soon as the backward has made its gradients. Smaller buckets
    hold fewer gradients at once and cost more, smaller collectives; a model smaller than one
    bucket is reduced all at once (``split_buckets`` is the rule).

    ``compile=True`` runs what each rank computes per micro-batch, its generated ``_forward`` (or
    each pipeline ``_stage{s}``), through ``torch.compile`` with ``compile_backend`` (default
    ``'inductor'``, which runs on the CPU as on GPUs; ``'aot_eager'`` needs no C++ compiler). Shapes are
    static: each new input shape compiles once more, and the module says so in a ``RecompileWarning``.
    A scheduler that splits the backward into B and W blocks (``zb_h1``, ``zbv``) cannot run compiled
    stages, whose backward is one graph, and is refused.
    The setting is saved with the generated files, because the loaded module reads it there; so
    turning it on or off regenerates them (``reuse='moo'``) or is refused by ``reuse='match'``.
    ``nbscaler.runtime.compiled`` says how.
    """

    plan_ngpus: int
    runtime_ngpus: int

    dynamic_shape: bool = True
    # Python control flow on values read from the input data: specialise on the traced value and
    # check it on every call (True), or refuse it at trace time (False).
    guard_data_dependent: bool = True

    use_zero: bool = False
    zero_ngroups: int = 1
    zero_stage: int = 1             # with use_zero: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
    zero_reshard_after_forward: bool = True     # stage 3: free a unit's gathered parameters after its forward
    zero_units: Tuple[str, ...] = ZERO_UNITS_DEFAULT    # stage 3: module paths or classes, each one unit
    reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES     # the most gradient bytes reduced as one bucket

    inference_only: bool = False
    use_end2end: bool = False

    use_pipeline: bool = False
    pipeline_nmicros: int = -1
    pipeline_nstages: int = -1
    pipeline_scheduler: Optional[str] = None
    # the stages on each pipeline device, for a scheduler that takes any number (1f1b_interleaved):
    # pipeline_nstages // it pipeline devices, each tensor-parallel over plan_ngpus // devices plan
    # devices (Megatron-LM's virtual pipeline size); -1: the scheduler's own, every plan device a
    # pipeline device for 1f1b_interleaved
    pipeline_virtual_stages: int = -1

    # run each rank's generated forward / stage methods through torch.compile, with this backend
    compile: bool = False
    compile_backend: str = DEFAULT_COMPILE_BACKEND

    pas_config: Dict[str, Any] = field(default_factory=dict)
    user_config: UserConfig = field(default_factory=UserConfig)

    def __post_init__(self) -> None:
        if isinstance(self.user_config, dict):
            object.__setattr__(self, "user_config", UserConfig(**self.user_config))
        object.__setattr__(self, "pas_config", dict(self.pas_config))
        self._merge_pipeline_keys()
        self._validate()

    # -- derived values ---------------------------------------------------------------------
    @functools.cached_property
    def grid(self) -> RankGrid:
        """Which ranks do what: units, plan devices, data-parallel and ZeRO groups and, with a
        pipeline, where its stages sit (the training schedule's geometry)."""
        pipeline = PipelineGeometry.from_config(self) if self.use_pipeline else None
        over_stage = self.use_zero and self.context_parallel > 1
        width = pipeline.tp if pipeline is not None else self.plan_ngpus
        return RankGrid(self.plan_ngpus, self.runtime_ngpus, self.zero_ngroups if self.use_zero else None, pipeline,
                        zero_over_stage=over_stage,
                        tensor_neighbours=width // self.context_parallel if over_stage and width % self.context_parallel == 0
                        else 1)

    @property
    def context_parallel(self) -> int:
        """The devices each stage's sequence is split over (``pas_config['context_parallel']``; 1: none)."""
        value = self.pas_config.get(CONTEXT_PARALLEL, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pas_config['{CONTEXT_PARALLEL}']={value!r} is invalid: give the number of devices "
                             "each stage's sequence is split over (an int >= 1; 1 turns it off).")
        return value

    @property
    def units(self) -> int:
        """Number of data-parallel copies of the plan (``runtime_ngpus // plan_ngpus``)."""
        return self.grid.units

    @property
    def sums_partial_grads_after_backward(self) -> bool:
        """Whether a weight whose ops split the batch inside a unit may leave its partial gradients
        to the reducer (bucketed, after the backward). Not under ZeRO stage 2, which reduces and
        frees gradients during the backward (nor stage 3): there each use sums its gradient as it is made.
        Except where ZeRO spans the devices that hold the parts (``RankGrid.zero_over_stage``): its
        reduce-scatter sums them."""
        return not (self.use_zero and self.zero_stage >= 2) or self.grid.zero_over_stage

    @property
    def scheduler(self) -> str:
        """The pipeline scheduler in effect (``1f1b`` when none was named)."""
        if self.pipeline_scheduler:
            return self.pipeline_scheduler
        return "infer_pipe" if self.inference_only else "1f1b"

    @property
    def virtual_stages(self) -> Optional[int]:
        """``pipeline_virtual_stages`` where given, else ``None`` (the scheduler decides)."""
        return None if self.pipeline_virtual_stages == -1 else self.pipeline_virtual_stages

    def unit_of(self, rank: int) -> int:
        """The unit ``rank`` belongs to (``RankGrid.unit_of``)."""
        return self.grid.unit_of(rank)

    def device_of(self, rank: int) -> int:
        """The plan device a runtime rank plays (``RankGrid.device_of``)."""
        return self.grid.device_of(rank)

    # -- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ComputeConfig":
        d = dict(d)
        d["user_config"] = UserConfig(**d.get("user_config", {}))
        return cls(**d)

    # -- checks -----------------------------------------------------------------------------
    def with_changes(self, **changes: Any) -> "ComputeConfig":
        """A validated copy with ``changes`` applied; a pipeline setting changes in both places it
        is kept (its field and ``pas_config``).

        >>> cfg = ComputeConfig(4, 4, use_pipeline=True, use_end2end=True, pipeline_nmicros=4)
        >>> cfg.with_changes(pipeline_nstages=2).pipeline_nstages
        2
        """
        pas_config = {**self.pas_config, **changes.pop("pas_config", {})}
        pas_config.update({k: v for k, v in changes.items() if k in PIPELINE_KEYS})
        return dataclasses.replace(self, **changes, pas_config=pas_config)

    def _validate_scheduler_rules(self) -> None:
        """The rules the scheduler declared where it registered (stages per device, micro-batches)."""
        spec = scheduler_spec(self.scheduler)
        virtual = self.virtual_stages
        nstages = self.pipeline_nstages if self.pipeline_nstages != -1 else spec.default_nstages(self.plan_ngpus, virtual)
        problem = spec.problem(nstages, self.pipeline_nmicros, self.plan_ngpus, virtual)
        if problem is not None:
            field_name, fix = problem
            _fail(field_name, getattr(self, field_name) if field_name != "pipeline_scheduler" else self.scheduler, fix)

    def _merge_pipeline_keys(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in PIPELINE_KEYS}
        for key in PIPELINE_KEYS:
            if key not in self.pas_config:
                continue
            from_pas, from_field = self.pas_config[key], getattr(self, key)
            if from_field != defaults[key] and from_field != from_pas:
                raise ValueError(
                    f"ComputeConfig.{key}={from_field!r} conflicts with pas_config['{key}']={from_pas!r}: "
                    f"give the pipeline setting in one place only, or make both equal."
                )
            object.__setattr__(self, key, from_pas)
        for key in PIPELINE_KEYS:
            self.pas_config.setdefault(key, getattr(self, key))

    def _validate_zero(self) -> None:
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            _fail("zero_stage", self.zero_stage, "use 1 (optimizer state sharded), 2 (gradients sharded too) or 3 "
                  "(parameters sharded too: fully sharded data parallelism).")
        if self.zero_stage != 1 and not self.use_zero:
            _fail("zero_stage", self.zero_stage, "ZeRO stages need ZeRO: set use_zero=True as well.")
        copies = scheduler_spec(self.scheduler).stage_copies if self.use_pipeline else 1
        if self.zero_stage >= 2 and copies > 1:
            _fail("zero_stage", self.zero_stage, f"{self.scheduler} sums the gradients of each stage's "
                  f"{_WORDS.get(copies, copies)} copies after the backward, which ZeRO-{self.zero_stage} has already "
                  f"freed by then; use zero_stage=1 with {self.scheduler}.")
        if not isinstance(self.zero_reshard_after_forward, bool):
            _fail("zero_reshard_after_forward", self.zero_reshard_after_forward, "give True or False.")
        if not self.zero_reshard_after_forward and self.zero_stage != 3:
            _fail("zero_reshard_after_forward", False, "only ZeRO stage 3 gathers parameters, so only it can keep "
                  "them gathered: set zero_stage=3 as well, or leave zero_reshard_after_forward=True.")
        units = self.zero_units
        if isinstance(units, str) or not isinstance(units, (list, tuple)) or not all(isinstance(u, str) and u for u in units):
            _fail("zero_units", units, "give module paths or class names, e.g. ('layers',) (each layer of a "
                  "ModuleList), ('blocks.3',) or ('TransformerBlock',); () for each repeated layer.")
        object.__setattr__(self, "zero_units", tuple(units))        # as a saved config.json reads back
        if units and self.zero_stage != 3:
            _fail("zero_units", tuple(units), "units are what ZeRO stage 3 gathers one at a time: set "
                  "zero_stage=3 as well, or leave zero_units empty.")

    def _validate_recompute(self) -> None:
        if RECOMPUTE in self.pas_config:
            granularity = self.pas_config[RECOMPUTE]
            allowed = [g.value for g in RecomputeGranularity]
            if not isinstance(granularity, str) or granularity not in allowed:
                raise ValueError(f"ComputeConfig.pas_config['recompute']={granularity!r} is invalid: use one of "
                                 f"{', '.join(repr(a) for a in allowed)} (nothing, the attention core of each "
                                 "layer, or each whole layer of the model's repeated layers).")
            if self.pas_config.get(RECOMPUTE_MODULES) is not None:
                raise ValueError(f"ComputeConfig.pas_config has both 'recompute'={granularity!r} and "
                                 f"'recompute_modules'={self.pas_config[RECOMPUTE_MODULES]!r}: they say the same "
                                 "thing two ways; give 'recompute' (none, selective or full) or name the modules "
                                 "with 'recompute_modules', not both.")
            self.pas_config[RECOMPUTE] = RecomputeGranularity(granularity).value   # a plain str, as JSON reads back
        names = self.pas_config.get(RECOMPUTE_MODULES)
        if names is None:
            return
        if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
                isinstance(n, str) and n for n in names):
            raise ValueError(f"ComputeConfig.pas_config['recompute_modules']={names!r} is invalid: give a list of "
                             "module paths or class names, e.g. ['blocks'] (every layer of a ModuleList), "
                             "['blocks.3'] or ['Block'].")
        self.pas_config[RECOMPUTE_MODULES] = list(names)        # as a saved config.json reads back

    def _validate_compile(self) -> None:
        if not isinstance(self.compile, bool):
            _fail("compile", self.compile, "give True (run each rank's generated methods through torch.compile) "
                  "or False (run them eagerly).")
        backend = self.compile_backend
        if backend == DEFAULT_COMPILE_BACKEND:
            return
        import torch._dynamo              # only here: importing it costs about a second
        known = torch._dynamo.list_backends(exclude_tags=())
        if not isinstance(backend, str) or backend not in known:
            _fail("compile_backend", backend, f"name a torch.compile backend: {DEFAULT_COMPILE_BACKEND!r} (the "
                  f"default), 'aot_eager', 'eager', or another of torch._dynamo.list_backends(exclude_tags=()).")
        if not self.compile:
            _fail("compile_backend", backend, "a backend is used only when compiling: set compile=True as well, "
                  f"or leave compile_backend={DEFAULT_COMPILE_BACKEND!r}.")

    def _validate_compiled_pipeline(self) -> None:
        """A compiled stage's backward is one graph making input and weight gradients together, run
        once (its buffers are donated): it cannot be split into a B and a later W block."""
        training_pipeline = self.use_pipeline and not self.inference_only
        if self.compile and training_pipeline and self.grid.pipeline.schedule.splits_backward:
            _fail("compile", True, f"{self.scheduler} splits each stage's backward into input-gradient and "
                  "weight-gradient blocks, and a compiled stage runs its backward as one graph that makes both "
                  f"at once: use compile=False with {self.scheduler}, or a scheduler that does not split the "
                  "backward (1f1b, gpipe, 1f1b_interleaved).")

    def _validate(self) -> None:
        for name in ("plan_ngpus", "runtime_ngpus", "zero_ngroups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "it must be a positive integer.")
        problem = RankGrid.problem(self.plan_ngpus, self.runtime_ngpus, self.zero_ngroups if self.use_zero else None)
        if problem is not None:
            _fail(problem[0], getattr(self, problem[0]), problem[1])
        bucket = self.reduce_bucket_bytes
        if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 1:
            _fail("reduce_bucket_bytes", bucket, "give the most gradient bytes summed as one bucket, a positive "
                  "integer, e.g. 25 * 2**20 (the default).")
        self._validate_zero()
        self._validate_recompute()
        self._validate_compile()
        if self.use_pipeline and not self.use_end2end:
            _fail("use_pipeline", True, "a pipeline needs an end2end module: set use_end2end=True as well.")
        if self.pipeline_scheduler is not None:
            known = TRAIN_SCHEDULERS + INFER_SCHEDULERS
            if self.pipeline_scheduler not in known:
                _fail("pipeline_scheduler", self.pipeline_scheduler, f"use one of {', '.join(known)}.")
            if self.pipeline_scheduler in INFER_SCHEDULERS and not self.inference_only:
                _fail(
                    "pipeline_scheduler", self.pipeline_scheduler,
                    "'infer_pipe' schedules inference only: set inference_only=True, or pick a training "
                    f"scheduler ({', '.join(TRAIN_SCHEDULERS)}).",
                )
        if self.use_pipeline:
            if not isinstance(self.pipeline_nmicros, int) or self.pipeline_nmicros < 1:
                _fail("pipeline_nmicros", self.pipeline_nmicros,
                      "a pipeline needs the number of micro-batches per train_step: set pipeline_nmicros >= 1.")
            if self.pipeline_nstages != -1 and (not isinstance(self.pipeline_nstages, int) or self.pipeline_nstages < 1):
                _fail("pipeline_nstages", self.pipeline_nstages, "it must be a positive integer.")
            virtual = self.pipeline_virtual_stages
            if virtual != -1 and (not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1):
                _fail("pipeline_virtual_stages", virtual, "give the stages on each pipeline device, a positive "
                      "integer (or -1 to leave them to the scheduler).")
            self._validate_scheduler_rules()
        self._validate_compiled_pipeline()
