"""The pipeline executor: run this rank's blocks of a schedule, in order.

For each block of its pipeline device, a rank:

- ``F(s, m)``: gets the tensors crossing into stage ``s`` for micro-batch ``m`` (from its own
  earlier block, or by ``recv`` from the neighbouring stage), runs the generated ``_stage{s}``, and
  sends what crosses out of it to the devices that run stage ``s + 1`` for ``m``;
- ``B(s, m)``: starts the backward from the loss (last stage) or from the gradients that stage
  ``s + 1`` sends back, runs ``torch.autograd.backward`` through the stage, and sends the gradients
  of the tensors that came in to stage ``s - 1``;
- with a zero-bubble schedule, ``B(s, m)`` computes only those input gradients (the data path,
  the graph kept) and ``W(s, m)``, later, the weights' gradients from where ``B`` left the data
  path (:mod:`~nbscaler.runtime.split_backward`); they accumulate into ``.grad`` and fire the
  gradient hooks (ZeRO-2's) as a whole backward does.

Sends are non-blocking (``isend``). Receives are posted ahead (``irecv``) for the next
``RECEIVE_AHEAD`` blocks that need one, so a message lands in its buffer while this rank is still
computing, and a block waits only for the tensors it needs itself, all of them together. Posting a
receive early never blocks, so a schedule the simulator proves free of deadlocks cannot deadlock
here either. Every message carries a tag made of (micro-batch, stage, phase, tensor), so two
pipelines sharing a link (``chimera_direct``) cannot mix their messages up.

The last stage's losses reach the other ranks of the unit without a collective: each rank posts
its receives for them when the step starts, and the rank that computed a loss sends it when its
blocks are done, so sharing them never makes the step wait for the slowest rank.

Each block is timed; ``events`` holds rows ``(rank, stage, micro, phase, t_start, t_end)`` in the
same format as the simulator's predicted timeline.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler.runtime import split_backward
from nbscaler.schedule import PipelineGeometry, PipelineSchedule, scheduler_spec


RECEIVE_AHEAD = 2     # blocks whose incoming messages are posted before their turn

Message = Tuple[str, int, int]      # (phase, stage, micro) of the block that receives it


def _tag(micro: int, stage: int, phase: str, index: int, nstages: int) -> int:
    return ((micro * nstages + stage) * 2 + (phase == "B")) * 1024 + index


class PipelineExecutor:
    """Runs one step of a schedule on this rank of a pipelined ``ParallelModule``."""

    def __init__(self, module, schedule: PipelineSchedule, mode: str):
        self.module = module
        self.schedule = schedule
        self.grid = module.compute_config.grid
        self.geometry = PipelineGeometry(schedule, self.grid.plan_ngpus)
        if scheduler_spec(schedule.name).one_device_per_stage and self.geometry.tp != 1:
            raise ValueError(f"{schedule.name} runs one device per stage: use policy 'pp' (not 'hybrid') with it.")
        self.mode = mode                      # 'any', 'train' or 'eval': which generated stages to call
        self.device = self.geometry.pipeline_device(module.plan_device)
        self.tp_index = self.geometry.tp_index(module.plan_device)
        self.unit = module.unit
        self.carry_spec = module.stage_carry[mode]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.events: List[Dict[str, Any]] = []
        self.losses: List[Optional[torch.Tensor]] = []    # after run: every micro-batch's loss (float32)
        self.weights_due: Dict[Tuple[int, int], split_backward.WeightPass] = {}   # B done, W not yet
        self.weights = [p for p in module.parameters() if p.requires_grad]

    # -- addressing -----------------------------------------------------------------------------
    def _rank_of(self, pipeline_device: int) -> int:
        return self.grid.rank_of(self.unit, self.geometry.plan_device(pipeline_device, self.tp_index))

    def _holders(self, stage: int, micro: int) -> Tuple[int, ...]:
        return self.schedule.devices_of(stage, micro)

    def _peers(self, stage: int, other: int, micro: int) -> Tuple[List[int], Optional[int]]:
        """For data flowing from ``stage`` to ``other`` for micro-batch ``micro``: the devices this
        one sends to (only the first holder of ``stage`` sends, and only to devices that do not
        hold ``stage`` themselves), and the device it receives from (``None``: it made the data)."""
        senders, receivers = self._holders(stage, micro), self._holders(other, micro)
        sends = [d for d in receivers if d not in senders] if self.device == min(senders) else []
        return sends, (None if self.device in senders else min(senders))

    # -- one step -------------------------------------------------------------------------------
    def run(self, samples: List[Any], train: bool, dummy: Optional[List[bool]] = None,
            scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Optional[Any]]:
        """Run every block; returns the last stage's outputs per micro-batch (None elsewhere)."""
        last = self.schedule.nstages - 1
        inputs: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = {}      # (stage, micro) -> leaves in
        outputs: Dict[Tuple[int, int], Any] = {}                         # (stage, micro) -> stage result
        grads_in: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = {}     # (stage, micro) -> grads of outputs
        results: List[Optional[Any]] = [None] * len(samples)
        pending: List[Any] = []
        incoming = self._post_loss_receives(len(samples))
        blocks = [b for b in self.schedule.blocks_of(self.device) if train or b.phase == "F"]
        receives = _Receives(self, [self._message(b.phase, b.stage, b.micro) for b in blocks])
        for position, block in enumerate(blocks):
            s, m = block.stage, block.micro
            receives.post_until(position + RECEIVE_AHEAD)
            # Waiting for a neighbour is bubble, not work: the clock starts once the inputs are here.
            if block.phase == "F":
                carry = self._receive_forward(s, m, outputs, receives) if s > 0 else {}
                start = time.perf_counter()
                inputs[(s, m)] = carry
                # No local names for a stage's outputs or roots: a split backward's W frees the
                # graph only when nothing else refers to it, and a name would keep it until rebound.
                with torch.set_grad_enabled(train):
                    outputs[(s, m)] = getattr(self.module, self._fn(s))(carry, samples[m])
                if s == last:
                    results[m] = outputs[(s, m)]
                else:
                    pending += self._send(s, s + 1, m, "F", outputs[(s, m)])
            elif block.phase == "B":
                grads = self._receive_backward(s, m, grads_in, receives) if s < last else {}
                start = time.perf_counter()
                in_grads = self._backward(self._roots(s, m, outputs.pop((s, m)), grads, dummy, scale_fn),
                                          inputs.pop((s, m)), (s, m))
                if s == last and self.schedule.splits_backward:
                    results[m] = _detached(results[m])     # the graph is W's now: it dies after W
                if s > 0:
                    grads_in[(s - 1, m)] = in_grads
                    pending += self._send(s, s - 1, m, "B", in_grads)
            else:
                start = time.perf_counter()
                self._weight_gradients((s, m))
            self.events.append({"rank": self.rank, "stage": s, "micro": m,
                                "phase": block.phase, "t_start": start, "t_end": time.perf_counter()})
        pending += self._send_losses(results)
        for work, _ in pending:
            work.wait()
        self.losses = self._gather_losses(results, incoming)
        return results

    # -- backward: whole, or split into input (B) and weight (W) gradients ----------------------
    def _roots(self, stage: int, micro: int, out: Any, grads: Dict[str, torch.Tensor], dummy: Optional[List[bool]],
               scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> Tuple[List[torch.Tensor], List[Any]]:
        """Where the backward of ``stage`` starts: the (scaled) loss on the last stage, else the
        outputs whose gradients came back, with those gradients."""
        if stage == self.schedule.nstages - 1:
            loss = _loss_of(out)
            if dummy is not None and dummy[micro]:
                loss = loss * 0.0                    # keeps the schedule's messages, adds no gradient
            return [scale_fn(loss) if scale_fn is not None else loss], [None]
        pairs = [(out[n], grads[n]) for n in out if out[n].requires_grad and n in grads]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _backward(self, roots: Tuple[List[torch.Tensor], List[Any]], carry: Dict[str, torch.Tensor],
                  key: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """The gradients of the stage's inputs. Without ``W`` blocks, the whole backward (weights
        included). With them, the inputs' gradients only, the graph kept for the ``W`` block."""
        tensors, grads = roots
        wanted = {n: t for n, t in carry.items() if t.requires_grad}
        if not self.schedule.splits_backward:
            if tensors:
                torch.autograd.backward(tensors, grads)
            return {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in wanted.items()}
        found, self.weights_due[key] = split_backward.split(roots, list(wanted.values()), self.weights)
        return {n: (g if g is not None else torch.zeros_like(t)) for (n, t), g in zip(wanted.items(), found)}

    def _weight_gradients(self, key: Tuple[int, int]) -> None:
        """The ``W`` block: accumulate the weights' gradients into ``.grad`` (their hooks fire
        here), then let the graph go. It starts where ``B`` left the data path (see
        :mod:`nbscaler.runtime.split_backward`), so collectives on that path run once, in ``B``;
        every rank of a stage runs the same blocks in the same order, so any collective on the
        weights' side meets its peers in ``W``. The module's ``weight_pass_observers`` hear it start
        and end."""
        observers = self.module.weight_pass_observers
        for observe in observers:
            observe(True)
        try:
            self.weights_due.pop(key).run()
        finally:
            for observe in observers:
                observe(False)

    # -- sharing the losses ---------------------------------------------------------------------
    def _loss_sender(self, micro: int) -> int:
        """The rank that sends micro-batch ``micro``'s loss: the first device holding the last
        stage for it, at tensor-parallel index 0."""
        device = min(self._holders(self.schedule.nstages - 1, micro))
        return self.grid.rank_of(self.unit, self.geometry.plan_device(device, 0))

    def _loss_tag(self, sender: int) -> int:
        beyond_blocks = _tag(self.schedule.nmicros, 0, "F", 0, self.schedule.nstages)    # no block uses it
        return beyond_blocks + sender

    def _loss_routes(self, nmicros: int) -> Dict[int, List[int]]:
        """Sender rank -> the micro-batches whose losses it sends, in order."""
        routes: Dict[int, List[int]] = {}
        for m in range(nmicros):
            routes.setdefault(self._loss_sender(m), []).append(m)
        return routes

    def _post_loss_receives(self, nmicros: int) -> Dict[int, Tuple[Any, torch.Tensor]]:
        """Post a receive for each other rank's losses, unless this rank computes them itself."""
        posted = {}
        last = self.schedule.nstages - 1
        for sender, micros in self._loss_routes(nmicros).items():
            if sender == self.rank or self.device in self._holders(last, micros[0]):
                continue
            buffer = torch.empty(len(micros), dtype=torch.float64, device=self.module.device)
            posted[sender] = (dist.irecv(buffer, sender, tag=self._loss_tag(sender)), buffer)
        return posted

    def _send_losses(self, results: List[Optional[Any]]) -> List[Any]:
        micros = self._loss_routes(len(results)).get(self.rank, [])
        if not micros:
            return []
        last = self.schedule.nstages - 1
        losses = torch.stack([_loss_of(results[m]).detach().double() for m in micros])
        receivers = [r for r in self.grid.unit_ranks(self.unit)
                     if r != self.rank and self.geometry.pipeline_device(self.grid.device_of(r)) not in
                     self._holders(last, micros[0])]
        return [(dist.isend(losses, r, tag=self._loss_tag(self.rank)), losses) for r in receivers]

    def _gather_losses(self, results: List[Optional[Any]], incoming) -> List[Optional[torch.Tensor]]:
        losses: List[Optional[torch.Tensor]] = [None if r is None else _loss_of(r).detach() for r in results]
        for sender, micros in self._loss_routes(len(results)).items():
            if sender in incoming:
                work, buffer = incoming[sender]
                work.wait()
                for m, value in zip(micros, buffer.float()):
                    losses[m] = value
        return losses

    def _fn(self, stage: int) -> str:
        return f"_stage{stage}" + ("" if self.mode == "any" else f"_{self.mode}")

    # -- messages -------------------------------------------------------------------------------
    def _send(self, stage: int, other: int, micro: int, phase: str, tensors: Dict[str, torch.Tensor]) -> List[Any]:
        """Start sending ``tensors`` (in name order); returns (work, buffer) pairs to wait on."""
        sends, _ = self._peers(stage, other, micro)
        works = []
        for dst in sends:
            for i, name in enumerate(sorted(tensors)):
                t = tensors[name].detach().contiguous()       # the buffer must live until the send ends
                works.append((dist.isend(t, self._rank_of(dst),
                                         tag=_tag(micro, stage, phase, i, self.schedule.nstages)), t))
        return works

    def _message(self, phase: str, stage: int, micro: int) -> Optional[Tuple[Message, int, List[Tuple[str, tuple, str]], int]]:
        """What block (phase, stage, micro) receives from another device: ``(key, source device,
        [(name, shape, dtype)], tag base)``, or ``None`` when it receives nothing."""
        last = self.schedule.nstages - 1
        if phase == "F" and stage > 0:
            _, src = self._peers(stage - 1, stage, micro)
            specs, sender = sorted(self.carry_spec[stage - 1]), stage - 1
        elif phase == "B" and stage < last:
            _, src = self._peers(stage + 1, stage, micro)
            specs = sorted(spec for spec in self.carry_spec[stage] if getattr(torch, spec[2]).is_floating_point)
            sender = stage + 1
        else:
            return None
        if src is None:
            return None
        return (phase, stage, micro), src, specs, _tag(micro, sender, phase, 0, self.schedule.nstages)

    def _receive_forward(self, stage: int, micro: int, outputs, receives: "_Receives") -> Dict[str, torch.Tensor]:
        _, src = self._peers(stage - 1, stage, micro)
        if src is None:      # this device ran stage - 1 for this micro-batch itself
            made = outputs[(stage - 1, micro)]
            return {n: t.detach().requires_grad_(t.is_floating_point()) for n, t in made.items()}
        carry = receives.wait(("F", stage, micro))
        return {n: t.requires_grad_(t.is_floating_point()) for n, t in carry.items()}

    def _receive_backward(self, stage: int, micro: int, grads_in, receives: "_Receives") -> Dict[str, torch.Tensor]:
        _, src = self._peers(stage + 1, stage, micro)
        if src is None:
            return grads_in.pop((stage, micro))
        return receives.wait(("B", stage, micro))


def _detached(output: Any) -> Any:
    """``output`` with every tensor in it detached from the graph."""
    return torch.utils._pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)


def _loss_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class _Receives:
    """The messages one step's blocks receive, in block order: posted ahead with ``irecv`` (each
    message's tensors together) and waited for by the block that needs them."""

    def __init__(self, executor: PipelineExecutor, messages: List[Optional[tuple]]):
        self.executor = executor
        self.messages = messages
        self.next = 0                     # the first block whose message is not posted yet
        self.posted: Dict[Message, Tuple[List[Any], Dict[str, torch.Tensor]]] = {}

    def post_until(self, end: int) -> None:
        """Post the receives of every block before ``end``."""
        while self.next < min(end, len(self.messages)):
            message = self.messages[self.next]
            self.next += 1
            if message is None:
                continue
            key, src, specs, tag = message
            rank, device = self.executor._rank_of(src), self.executor.module.device
            tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                       for name, shape, dtype in specs}
            works = [dist.irecv(t, rank, tag=tag + i) for i, t in enumerate(tensors.values())]
            self.posted[key] = (works, tensors)

    def wait(self, key: Message) -> Dict[str, torch.Tensor]:
        works, tensors = self.posted.pop(key)
        for work in works:
            work.wait()
        return tensors
