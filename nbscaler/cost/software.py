"""``Software``: the kernels and overlap a target's training framework runs, where they change the physics.

Two runs on the same GPUs differ by their software as much as by anything else: how attention is
computed, which elementwise kernels are fused, whether the gradient reduction hides behind the
backward. A target (``Hardware``) carries one ``Software``; the catalogue's is today's PyTorch
(FlashAttention through ``scaled_dot_product_attention``, DDP's overlapped reduction, no fused
bias-dropout-add). The recipe (``nbscaler.Recipe``) says the rest of how a run trains: its dtypes,
optimizer, loss scaling and gradient clipping.

- ``attention``: an ``AttentionKind``. FlashAttention-2 by default (PyTorch's SDPA); ``cudnn``
  cuDNN's fused attention, the same algorithm on faster kernels (Transformer Engine's on Hopper GPUs,
  so Megatron-LM's and NeMo's); ``materialized`` writes the (B, heads, T, S) scores to memory, as
  frameworks did before FlashAttention (Megatron-LM in 2021).
- ``attention_dropout``: the probability with which the framework drops attention probabilities
  (Megatron-LM's ``--attention-dropout``). It costs a pass over the scores when they are
  materialised; FlashAttention drops them on chip, from a regenerated random state, for nothing.
- ``fused_softmax``: with materialised scores, the scale, the causal mask and the softmax run as one
  kernel (Megatron-LM's ``--masked-softmax-fusion``, on by default) instead of three passes over the
  scores.
- ``fused_bias_dropout_add``: a dropout before a residual add runs fused with the add, one kernel
  (Megatron-LM's ``--bias-dropout-fusion``, on by default): the dropout's output is never written
  and read again.
- ``overlap_grad_reduce``: the data-parallel reduction runs during the backward on its own stream
  (PyTorch DDP, FSDP, Megatron-LM's ``--overlap-grad-reduce`` since 2023), or waits for its end.
- ``compiled``: the model runs through a compiler that fuses each chain of element-wise ops, norms
  and reductions into one kernel (``torch.compile``'s inductor): the chain reads its inputs and
  writes its outputs once (``cost.fusion``), and an fp8 recipe's scale and cast passes run as two
  kernels a tensor instead of eager PyTorch's five (``cost.roofline``). Off by default: eager PyTorch.
- ``compiled_modules``: where ``compiled``, the modules the compiler sees, each in a graph of its own
  (``cost.fusion.compiled_unit``: a name matches any run of a module path's parts, and a list of
  blocks is compiled block by block: torchtitan's ``("layers",)``, which leaves the embeddings, the
  final norm, the output layer and the loss eager); empty: the whole model as one graph.

>>> megatron_2021 = Software(attention="materialized", attention_dropout=0.1, fused_bias_dropout_add=True,
...                          overlap_grad_reduce=False, name="Megatron-LM 2021")
>>> megatron_2021.describe()
'Megatron-LM 2021: attention materialized (fused scale-mask-softmax), attention dropout 0.1, bias-dropout-add fused, gradient reduction after the backward'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

from nbscaler.columns import StrEnum


class AttentionKind(StrEnum):
    """How the target computes ``scaled_dot_product_attention`` (``cost.roofline`` prices each)."""

    FLASH = "flash"                  # FlashAttention-2 (Dao 2023): scores stay on chip, recomputed in the backward
    CUDNN = "cudnn"                  # cuDNN's fused attention (Transformer Engine's, SDPA's cuDNN backend): flash's way, its own kernels
    MATERIALIZED = "materialized"    # Q K^T written to memory (B, heads, T, T), a softmax over it, then P V

    @property
    def fused(self) -> bool:
        """Whether the scores stay on chip, so that a causal or windowed kernel skips the masked blocks."""
        return self != AttentionKind.MATERIALIZED


_FLAGS = {"fused_softmax": "True (scale, mask and softmax in one kernel) or False (three passes)",
          "fused_bias_dropout_add": "True (dropout and residual add in one kernel) or False",
          "overlap_grad_reduce": "True (reduce during the backward) or False (after it)",
          "compiled": "True (element-wise chains compiled into one kernel each, torch.compile) or False (eager)"}


@dataclass(frozen=True)
class Software:
    """A target's training software; see the module docstring. Checks itself on construction."""

    attention: AttentionKind = AttentionKind.FLASH
    attention_dropout: float = 0.0
    fused_softmax: bool = True
    fused_bias_dropout_add: bool = False
    overlap_grad_reduce: bool = True
    compiled: bool = False
    compiled_modules: Tuple[str, ...] = ()
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.attention not in set(AttentionKind):
            raise ValueError(f"Software(attention={self.attention!r}) is invalid: give one of "
                             f"{', '.join(k.value for k in AttentionKind)}.")
        object.__setattr__(self, "attention", AttentionKind(self.attention))
        for flag, meaning in _FLAGS.items():
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Software({flag}={getattr(self, flag)!r}) is invalid: give {meaning}.")
        modules = (self.compiled_modules,) if isinstance(self.compiled_modules, str) else tuple(self.compiled_modules)
        if not all(isinstance(m, str) and m for m in modules) or (modules and not self.compiled):
            raise ValueError(f"Software(compiled_modules={self.compiled_modules!r}) is invalid: give the names of "
                             "the modules the compiler sees, e.g. ('layers',), with compiled=True.")
        object.__setattr__(self, "compiled_modules", modules)
        p = self.attention_dropout
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1):
            raise ValueError(f"Software(attention_dropout={p!r}) is invalid: give a probability in [0, 1) "
                             f"(0: no attention probabilities dropped).")

    def replace(self, **changes) -> "Software":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line a summary or a results table can print."""
        materialized = self.attention == AttentionKind.MATERIALIZED
        parts = [f"attention {self.attention.value}"
                 + ((" (fused scale-mask-softmax)" if self.fused_softmax else " (scale, mask, softmax apart)")
                    if materialized else "")]
        if self.attention_dropout:
            parts.append(f"attention dropout {self.attention_dropout:g}")
        parts.append("bias-dropout-add fused" if self.fused_bias_dropout_add else "dropout and add apart")
        parts.append("gradient reduction " + ("during" if self.overlap_grad_reduce else "after") + " the backward")
        if self.compiled:
            where = f" in {', '.join(self.compiled_modules)}" if self.compiled_modules else ""
            parts.append(f"compiled{where} (element-wise chains fused)")
        return (f"{self.name}: " if self.name else "") + ", ".join(parts)
