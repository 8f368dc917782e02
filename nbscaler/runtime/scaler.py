"""``LossScaler``: dynamic loss scaling for fp16 training, as ``torch.amp.GradScaler`` does it.

fp16 holds numbers up to 65504 and down to about 6e-8 (6e-5 at full precision), so in fp16 small
gradients underflow to zero (bf16 has fp32's range and rarely needs a scale). Multiplying the loss by a large ``scale`` before the
backward lifts every gradient by the same factor; the optimizer divides it out again (in the master
dtype) before it steps. A scale too large overflows some gradient to inf: then the step is skipped,
on every rank alike, and the scale is lowered (``backoff_factor``); after ``growth_interval``
steps in a row without overflow it is raised again (``growth_factor``).

>>> scaler = LossScaler(init_scale=2.0**16)
>>> opt = build_optimizer(pm, torch.optim.AdamW, master_dtype=torch.float32, scaler=scaler)  # doctest: +SKIP
>>> pm.train_step(samples, scale_fn=scaler.scale); opt.step()                               # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch
import torch.distributed as dist


class LossScaler:
    """The loss scale and its rules: ``scale`` the loss, ``unscale`` the gradients, ``update``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                             f"{backoff_factor}, growth_interval={growth_interval}) is invalid: it needs "
                             "init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1.")
        self.value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0           # steps without overflow since the scale last changed
        self.skipped = 0              # steps skipped so far

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale: call backward on this (``train_step(..., scale_fn=scaler.scale)``)."""
        return loss * self.value

    @torch.no_grad()
    def unscale(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Divide ``grads`` by the scale in place; whether any rank found an inf or a nan in its own.

        Every rank must call it at the same point: the finding is all-reduced so that all of them
        skip the same steps (with ZeRO each rank sees only its shard of the gradients).
        """
        found = torch.zeros((), device=device)
        for g in grads:
            g.mul_(1.0 / self.value)
            found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.dtype))
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found)

    def update(self, overflowed: bool) -> None:
        """Lower the scale after an overflow; raise it after ``growth_interval`` good steps."""
        if overflowed:
            self.value *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.value *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.value = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
