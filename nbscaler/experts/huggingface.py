"""Hugging Face's expert modules recorded as nbscaler's routed-experts op.

Mixtral, Qwen3-MoE and the other models whose experts class Hugging Face builds with
``use_experts_implementation`` keep their experts' weights batched, as nbscaler does, but concatenated
and the other way round: ``gate_up_proj`` ``(E, 2h, d)`` (gate rows, then up rows) and ``down_proj``
``(E, d, h)``, or ``(E, d, 2h)`` and ``(E, h, d)`` when ``is_transposed``. Their forward takes the
tokens, the chosen experts and the router's weights of them, and serves every pair: exactly
``dropless_experts``. Recorded as that op, with its weights as views of Hugging Face's parameters
(a chunk and a transpose, no copy), an expert-parallel plan splits Hugging Face's parameters by
expert and a tensor-parallel one splits every expert, as for nbscaler's own MoE.

Only the layout ``dropless_experts`` computes is recorded so: SiLU-gated, concatenated, no biases,
no norm after the experts, not already split by Hugging Face's own expert parallelism. Any other
experts module is traced call by call, as before.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from nbscaler.experts.routing import dropless_experts

_HF_MOE = "transformers.integrations.moe"      # where Hugging Face's experts decorator lives


def is_gated_silu(module: nn.Module) -> bool:
    """Whether ``module``'s activation is SiLU: an ``nn.SiLU``, or Hugging Face's ``'silu'``
    (``transformers.activations.SiLUActivation``, ``F.silu``)."""
    act = type(getattr(module, "act_fn", None))
    return issubclass(act, nn.SiLU) or (act.__module__, act.__name__) == ("transformers.activations", "SiLUActivation")


def recordable(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module in the layout ``dropless_experts`` computes."""
    flags = ("has_gate", "is_concatenated")
    if not all(getattr(module, f, False) for f in flags):
        return False
    if any(getattr(module, f, True) for f in ("has_bias", "has_post_expert_norm", "_is_expert_parallel")):
        return False
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3:
        return False
    gate = getattr(type(module), "_apply_gate", None)        # act(gate) * up, unless the model has its own
    default = (getattr(gate, "__module__", None), getattr(gate, "__name__", None)) == (_HF_MOE, "_default_apply_gate")
    return is_gated_silu(module) and default


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """``module``'s forward as ``dropless_experts``: ``hidden_states`` ``(n, d)``, ``top_k_index`` and
    ``top_k_weights`` ``(n, k)`` -> ``(n, d)``."""
    if module.is_transposed:                                               # (E, d, 2h), (E, h, d)
        w1, w3 = module.gate_up_proj.chunk(2, dim=2)                       # (E, d, h) each
        w2 = module.down_proj
    else:                                                                  # (E, 2h, d), (E, d, h)
        gate, up = module.gate_up_proj.chunk(2, dim=1)                     # (E, h, d) each
        w1, w3, w2 = gate.transpose(1, 2), up.transpose(1, 2), module.down_proj.transpose(1, 2)
    return dropless_experts(hidden_states, top_k_weights, top_k_index, w1, w3, w2)


def experts_stand_in(module: nn.Module) -> Optional[Callable[..., torch.Tensor]]:
    """The forward the tracer records in place of ``module``'s (``experts_forward`` bound to it), or
    ``None`` when ``module`` is not a Hugging Face experts module ``dropless_experts`` computes."""
    if not recordable(module):
        return None
    return lambda hidden_states, top_k_index, top_k_weights: experts_forward(module, hidden_states, top_k_index,
                                                                            top_k_weights)
