"""``ParallelModule``: the base class of every generated per-rank module.

Generated code supplies the forward and a ``weight_specs`` table; this class does the rest:

- creates the local parameters and buffers (each a slice of an original tensor) and fills them from
  a weights source: the initial weights that ``parallelize`` saved, or for a module built on the
  meta device its checkpoint or its own initialisation, read slice by slice
  (``nbscaler.runtime.sources``);
- creates the process groups the forward's collectives run in, for this rank's unit;
- sums gradients inside its unit and across data-parallel units (``Reducer``, or ``ZeroReducer``
  to shard the optimizer state) when the optimizer steps (``nbscaler.runtime.grad_sync``);
- saves, with its state dict, a record of which slice of which original tensor each local tensor
  is, and refuses to load a state dict whose record differs;
- runs ``train_step``/``infer_step`` for end2end modules;
- with ``ComputeConfig(compile=True)``, runs its generated methods through ``torch.compile``
  (``nbscaler.runtime.compiled``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from nbscaler.genfiles import WEIGHTS_FILE
from nbscaler.config import ComputeConfig
from nbscaler.recipe import Recipe
from nbscaler.runtime.compiled import CompiledMethod, compile_methods
from nbscaler.runtime.grad_sync import module_reducer, replica_reducers, sharded_attrs
from nbscaler.runtime.groups import ensure_groups, get_group
from nbscaler.runtime.pipeline import PipelineExecutor
from nbscaler.runtime.reducer import Slot
from nbscaler.runtime.sources import TorchFile, WeightSource
from nbscaler.runtime.summary import module_html
from nbscaler.runtime.statecheck import EXTRA_STATE, MODULE_FORMAT, check_no_extra, check_record, check_tensors
from nbscaler.runtime.weight_spec import WeightSpec        # generated code imports it from here
from nbscaler.runtime.fsdp import ShardedUnits
from nbscaler.schedule import PipelineGeometry, Timeline, check_samples


def runtime_device() -> torch.device:
    """``cuda:<local rank>`` under nccl, the CPU otherwise."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


class ParallelModule(torch.nn.Module):
    """One rank's share of a parallelized module. Subclasses are generated; do not write one by hand."""

    rank: ClassVar[int] = 0
    plan_device: ClassVar[int] = 0
    device_groups: ClassVar[List[Tuple[int, ...]]] = []
    weight_specs: ClassVar[Dict[str, WeightSpec]] = {}
    original_params: ClassVar[Tuple[str, ...]] = ()     # every parameter of the original module, in its order
    shard_units: ClassVar[Dict[str, Tuple[str, ...]]] = {}  # ZeRO-3: unit -> the attributes of its parameters
    compute_config: ClassVar[ComputeConfig]
    gen_dir: ClassVar[Path]
    weights_source: ClassVar[Dict[str, Any]] = {"source": WEIGHTS_FILE}   # the generated file says which

    def __init__(self, init_params: bool = True, weights: Optional[WeightSource] = None):
        super().__init__()
        cfg = self.compute_config
        self.device = runtime_device()
        self.world_rank = self._check_world()
        self.unit = cfg.grid.unit_of(self.world_rank)
        ensure_groups(cfg.grid, self.device_groups)
        sharded = sharded_attrs(self)
        for attr, spec in self.weight_specs.items():
            empty = torch.empty(spec.local_shape, dtype=spec.dtype, device=self.device)
            if attr in sharded:             # ZeRO-3: no storage until its unit is gathered
                empty.untyped_storage().resize_(0)
            if spec.kind == "param":
                self.register_parameter(attr, torch.nn.Parameter(empty))
            else:
                self.register_buffer(attr, empty, persistent=spec.persistent)
        source = self._initial_source(weights) if init_params else None
        if source is not None:
            self._copy_from(source, [attr for attr in self.weight_specs if attr not in sharded])
        self.reducer = module_reducer(self, source)
        self.replica_reducers = replica_reducers(self)
        self.pipeline_events: List[Dict[str, Any]] = []
        # Called with True before and False after each W block (a split backward's weight
        # gradients, several calls of autograd's engine): ``MemoryMeter`` counts it as one backward.
        self.weight_pass_observers: List[Callable[[bool], None]] = []
        self._pipeline_geometries: Dict[bool, PipelineGeometry] = {}     # train -> the schedule's geometry
        self.register_load_state_dict_pre_hook(self._before_load)
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module._gather_all())
        self.register_state_dict_post_hook(lambda module, *args: module._after_state_dict(*args))
        self.register_load_state_dict_post_hook(lambda module, keys: self.reducer.refresh_masters())
        self._in_step = False
        # Last: the compiled methods close over the module as it is now built.
        self.compiled_methods: Dict[str, CompiledMethod] = compile_methods(self) if cfg.compile else {}

    @property
    def compile_seconds(self) -> Optional[float]:
        """Seconds this rank has spent in ``torch.compile`` (forward and backward graphs, every
        shape so far); ``None`` when the module runs eagerly (``ComputeConfig.compile=False``)."""
        if not self.compute_config.compile:
            return None
        return sum(method.seconds for method in self.compiled_methods.values())

    @property
    def compile_events(self) -> List[Dict[str, Any]]:
        """One row per compile this rank ran (``nbscaler.runtime.compiled.COMPILE_COLUMNS``): ``rank,
        method, kind`` (``CompileKind``: forward or backward), ``inputs`` (the shapes it was compiled
        for) and ``seconds``; empty when running eagerly."""
        return [event for method in self.compiled_methods.values() for event in method.events]

    @property
    def shards(self) -> ShardedUnits:
        """ZeRO stage 3's units (the generated forward gathers and frees them through it)."""
        if not isinstance(self.reducer, ShardedUnits):
            raise RuntimeError("this parallel module does not shard its parameters: only ComputeConfig(use_zero=True, "
                               "zero_stage=3) has units to gather.")
        return self.reducer

    def _check_world(self) -> int:
        cfg = self.compute_config
        if not dist.is_initialized():
            if cfg.runtime_ngpus == 1:
                return 0
            raise RuntimeError(
                f"this parallel module runs on {cfg.runtime_ngpus} ranks, but torch.distributed is not "
                "initialized: start the ranks with torchrun, nbscaler.cluster.Cluster or "
                "nbscaler.runtime.launch.spawn, or call parallelize(..., load_module=False) to only compile.")
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != cfg.runtime_ngpus:
            raise RuntimeError(f"the plan was compiled for runtime_ngpus={cfg.runtime_ngpus}, but the process "
                               f"group has {world} ranks; compile again with runtime_ngpus={world}.")
        if cfg.grid.device_of(rank) != self.plan_device:
            raise RuntimeError(f"rank {rank} loaded the code of plan device {self.plan_device} "
                               f"(gencode{self.rank}.py); load gencode{rank}.py instead.")
        return rank

    # -- groups and weights ---------------------------------------------------------------------
    def group(self, *devices: int) -> Optional[dist.ProcessGroup]:
        """The process group of plan ``devices`` inside this rank's unit."""
        return get_group(self.compute_config.grid.unit_ranks(self.unit, devices))

    @torch.no_grad()
    def load_initial_weights(self, weights: Optional[WeightSource] = None) -> None:
        """Fill parameters and buffers with their slices of the original tensors, read from
        ``weights`` (``nbscaler.runtime.sources``; for a module built on the meta device,
        ``parallelize`` passes its checkpoint or its seeded initialisation), or by default from the
        values the module had when it was traced (``weights.pt``)."""
        with self.whole_parameters(write=True):
            self._copy_from(self._initial_source(weights), list(self.weight_specs))

    def _initial_source(self, weights: Optional[WeightSource]) -> WeightSource:
        """``weights``, or the values the module had when it was traced (``weights.pt``)."""
        if weights is not None:
            return weights
        path = Path(self.gen_dir) / WEIGHTS_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: this rank has no initial weights (broadcast_strategy='no_weights' or "
                "'code'?). Construct with init_params=False and call broadcast_weights, or load a checkpoint.")
        return TorchFile(path)

    @torch.no_grad()
    def _copy_from(self, source: WeightSource, attrs: List[str]) -> None:
        """Copy ``attrs``' slices from ``source`` into the local tensors (which must have storage)."""
        for attr, local in source.read_all({attr: self.weight_specs[attr] for attr in attrs}):
            getattr(self, attr).copy_(local)

    # -- training support -----------------------------------------------------------------------
    def parameters_for_optimizer(self) -> List[torch.nn.Parameter]:
        """The parameters this rank's optimizer updates: the trainable parameters, or with ZeRO
        this rank's flat shards of them; with master copies (``set_precision``), copies of those."""
        return [param for param, _ in self.optimizer_slots()]

    def optimizer_slots(self) -> List[Slot]:
        """Each optimizer parameter with the segments of local parameters it holds."""
        return self.reducer.optimizer_slots()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, with ZeRO those of the optimizer's shards as well."""
        super().zero_grad(set_to_none)
        self.reducer.zero_grad()

    def set_precision(self, precision: Recipe) -> None:
        """Sum gradients in ``precision``'s reduction dtype and let the optimizer update master
        copies where it asks for them (``build_optimizer`` calls this before reading the slots)."""
        for reducer in self.replica_reducers:       # sums inside the unit: back into the module's grads
            reducer.set_precision(precision, masters=False)
        self.reducer.set_precision(precision)

    def sync_grads(self) -> None:
        """Sum gradients over copies of a pipeline stage, then over the data-parallel units."""
        for reducer in self.replica_reducers:
            reducer.sync()
        self.reducer.sync()

    def gather_params(self) -> None:
        """Bring every rank's parameters up to date after an optimizer step (ZeRO only)."""
        self.reducer.gather_params()

    def grad_sq_sum(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: summed over all ranks, it counts
        each element of the original model once."""
        # a ZeRO over the stage's devices that hold one slice gives each of them its own shard of it:
        # the copies left are a tied weight's in other stages, and a whole weight's in the other
        # tensor-parallel places of a context-parallel group
        grid = self.compute_config.grid
        spread = len(grid.same_weight_devices(self.plan_device))
        copies = {id(getattr(self, attr)): spec.copies / spread for attr, spec in self.weight_specs.items()}
        return self.reducer.grad_sq_sum(lambda p: 1.0 / copies[id(p)])

    # -- checkpoints ----------------------------------------------------------------------------
    def get_extra_state(self) -> Dict[str, Any]:
        """The layout record saved as ``_extra_state``: enough to merge a list of per-rank state
        dicts without the modules, and to refuse a state dict saved by another plan."""
        cfg = self.compute_config
        return {"format": MODULE_FORMAT, "rank": self.world_rank, "plan_device": self.plan_device,
                "plan_ngpus": cfg.plan_ngpus, "runtime_ngpus": cfg.runtime_ngpus,
                "weights": {attr: spec.to_dict() for attr, spec in self.weight_specs.items()}}

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore: the layout is the generated code's, and the load pre-hook has already
        checked that the saved one is the same."""

    def check_state_dict(self, state_dict: Dict[str, Any], prefix: str = "", strict: bool = True) -> None:
        """Raise ``CheckpointError`` unless this module's entries (under ``prefix``) were saved by the
        same plan and hold every tensor in its shape. ``load_state_dict`` runs it before it copies
        anything, so a checkpoint that does not fit changes nothing."""
        where = f"the state dict at '{prefix}'" if prefix else "the state dict"
        check_record(self.get_extra_state(), state_dict.get(prefix + EXTRA_STATE), where)
        expected = [(prefix + attr, f"'{prefix}{attr}' ({spec.name})", spec.local_shape)
                    for attr, spec in self.weight_specs.items() if spec.persistent]
        check_tensors(expected, state_dict, strict)
        if strict:
            check_no_extra([k for k in state_dict if k.startswith(prefix)],
                           [key for key, _, _ in expected] + [prefix + EXTRA_STATE])

    def _before_load(self, module, state_dict: Dict[str, Any], prefix: str, local_metadata, strict: bool, *_) -> None:
        self.check_state_dict(state_dict, prefix, strict)
        self._gather_all()          # ZeRO-3: the loaded values land in the gathered parameters, then in the shards

    @contextlib.contextmanager
    def whole_parameters(self, write: bool = False) -> Iterator[None]:
        """Every local parameter readable (and, with ``write``, writable) inside the block.

        Under ZeRO stage 3 the parameters exist between steps only as shards: the block gathers
        every unit on entry and frees them on exit, first copying what was written into the
        shards. Elsewhere it only refreshes the master copies from what was written.
        """
        self._gather_all()
        try:
            yield
        finally:
            if write:
                self.reducer.refresh_masters()
            elif isinstance(self.reducer, ShardedUnits):
                self.reducer.free_all()

    def _gather_all(self) -> None:
        if isinstance(self.reducer, ShardedUnits):
            self.reducer.gather_all()

    def _after_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """ZeRO-3: the state dict holds copies of the gathered parameters, which are freed again."""
        if not isinstance(self.reducer, ShardedUnits):
            return
        for attr, spec in self.weight_specs.items():
            key = prefix + attr
            if spec.kind == "param" and key in state_dict:
                state_dict[key] = state_dict[key].clone()
        self.reducer.free_all()

    def _on_device(self, inputs: Any) -> Any:
        """``inputs`` with every tensor on this rank's device, as DDP moves its inputs: a data loader
        on the CPU feeds a rank on a GPU unchanged. Tensors already there are passed through."""
        device = self.device
        return tree_map(lambda t: t.to(device, non_blocking=True)
                        if isinstance(t, torch.Tensor) and t.device != device else t, inputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One rank's forward of the plan; tensors in the arguments are moved to its device first."""
        args, kwargs = self._on_device((args, kwargs))
        if self.compute_config.use_end2end and not self._in_step:
            raise RuntimeError("this is an end2end parallel module: call train_step(samples) to train and "
                               "infer_step(samples) to infer, not the module itself.")
        forward = self._forward if hasattr(self, "_forward") else (self._forward_train if self.training else self._forward_eval)
        out = forward(*args, **kwargs)
        if isinstance(self.reducer, ShardedUnits) and not torch.is_grad_enabled():
            self.reducer.free_all()         # ZeRO-3: no backward will free the units the forward kept
        return out

    def train_step(self, samples: List[Any], is_dummy_batch: Optional[List[bool]] = None,
                   scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Any]:
        """Forward and backward each sample, accumulating (summing) gradients; returns the outputs.

        Gradients are zeroed first. A sample marked in ``is_dummy_batch`` runs forward only and
        contributes no gradient; ``scale_fn`` scales each loss before its backward.
        """
        self._require_end2end("train_step")
        if is_dummy_batch is not None and len(is_dummy_batch) != len(samples):
            raise ValueError(f"is_dummy_batch has {len(is_dummy_batch)} entries for {len(samples)} samples")
        self.zero_grad()
        if self.compute_config.use_pipeline:
            return self._run_pipeline(samples, True, is_dummy_batch, scale_fn)
        outputs = []
        self._in_step = True
        try:
            for i, sample in enumerate(samples):
                dummy = bool(is_dummy_batch[i]) if is_dummy_batch is not None else False
                with torch.set_grad_enabled(not dummy):
                    out = self.forward(sample)
                loss = out[0] if isinstance(out, (tuple, list)) else out
                if not dummy:
                    (scale_fn(loss) if scale_fn is not None else loss).backward()
                outputs.append(_detach(out))
        finally:
            self._in_step = False
        return outputs

    @torch.no_grad()
    def infer_step(self, samples: List[Any]) -> List[Any]:
        """Forward each sample without gradients; returns the outputs."""
        self._require_end2end("infer_step")
        if self.compute_config.use_pipeline:
            return self._run_pipeline(samples, False)
        self._in_step = True
        try:
            return [self.forward(sample) for sample in samples]
        finally:
            self._in_step = False

    def _run_pipeline(self, samples: List[Any], train: bool, dummy: Optional[List[bool]] = None,
                      scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Any]:
        """One pipelined step; every rank of the unit gets the loss of every micro-batch back."""
        samples = self._on_device(samples)
        if train not in self._pipeline_geometries:            # built once: a step only reads it
            self._pipeline_geometries[train] = PipelineGeometry.from_config(self.compute_config, train=train)
        geometry = self._pipeline_geometries[train]
        check_samples(geometry.schedule, len(samples))
        mode = "any" if "any" in self.stage_carry else ("train" if self.training else "eval")
        executor = PipelineExecutor(self, geometry.schedule, mode)
        outputs = executor.run(samples, train, dummy, scale_fn)
        self.pipeline_events = executor.events
        # The last stage has the outputs; the executor sent its losses to the rest of the unit.
        return [_detach(out) if out is not None else executor.losses[m] for m, out in enumerate(outputs)]

    def _repr_html_(self) -> str:
        return module_html(self)

    def pipeline_timeline(self) -> Timeline:
        """The blocks the last pipelined step ran on this rank, timed: this rank's measured timeline.

        Its ``bubble_fraction`` is this rank's idle share between its own first and last block.
        The pipeline's bubble, as ``plan.timeline()`` predicts it, is that of every rank's rows
        together (``Timeline.from_rows(rows_of_all_ranks, nranks)``; on a cluster,
        ``result.timeline(step)``): the later stages also idle before their first block and after
        their last.
        """
        return Timeline.from_rows(self.pipeline_events, nranks=1)

    def _require_end2end(self, what: str) -> None:
        if not self.compute_config.use_end2end:
            raise RuntimeError(f"{what} needs an end2end module: parallelize with ComputeConfig(use_end2end=True), "
                               "or call the module directly.")


def _detach(value: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)
