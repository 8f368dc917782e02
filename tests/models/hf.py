"""Hugging Face transformers models from tiny configs (random weights, nothing downloaded).

Each is wrapped the way a training script uses it: ``model(**batch).loss``. The wrapper takes the
whole batch as its one argument, so the same module is end2end for pipelines. Dropout is off so
that every run computes the same thing. Batches are what users pass: ``input_ids``, ``labels`` and
a 2-D all-ones ``attention_mask`` (the model builds its causal mask from it).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn as nn

VOCAB, SEQ = 64, 8


class LossOf(nn.Module):
    """``forward(batch) -> model(**batch).loss``: a transformers model as a training loop calls it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _decoder_kwargs() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_decoder_kwargs()))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_decoder_kwargs()))


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_decoder_kwargs(), sliding_window=None))


def mixtral(hidden_act: str = "silu") -> nn.Module:
    """Mixtral: 4 experts, 2 per token. With SiLU (its own) nbscaler records its experts as
    ``dropless_experts``; with any other activation they are traced call by call, through
    ``torch._grouped_mm`` (``nbscaler.experts.huggingface``)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**_decoder_kwargs(), num_local_experts=4, num_experts_per_tok=2,
                                            router_jitter_noise=0.0, hidden_act=hidden_act))


def qwen3_moe() -> nn.Module:
    """Qwen3-MoE: 4 experts, 2 per token, renormalised top-k weights, every layer sparse."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_decoder_kwargs(), num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True,
                                              head_dim=8))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


BUILDERS: Dict[str, Callable[[], nn.Module]] = {
    "hf_llama": llama, "hf_qwen2": qwen2, "hf_mistral": mistral, "hf_mixtral": mixtral, "hf_qwen3_moe": qwen3_moe,
    "hf_gpt2": gpt2, "hf_bert": bert,
}


def build(name: str) -> nn.Module:
    return LossOf(BUILDERS[name]())


def batch(name: str, g: torch.Generator, batch_size: int = 4) -> dict:
    """Token ids with themselves as labels (the models shift them) and an all-ones 2-D mask."""
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return {"batch": {"input_ids": ids, "labels": ids.clone(),
                      "attention_mask": torch.ones(batch_size, SEQ, dtype=torch.long)}}
