"""Published runs as data: what each measured, on what, and the facts of the software it ran.

**Megatron-LM, 2021.** Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC21; also Megatron-LM's README of 2021): GPT models with a
vocabulary of 51,200 and sequences of 2,048 on DGX A100 (80 GB) nodes of 8 GPUs. Their TFLOP/s per
GPU is the paper's count of a step's FLOPs (its equation 3, ``paper_flops``: every attention pair,
the recomputed forward included) over the measured step, per GPU; so a row's published step time
is ``paper_flops / (TFLOP/s x GPUs)``, and a prediction is compared by its step time.

The facts of the 2021 software, each with its source (``MEGATRON_2021``):

- ``attention="materialized"``: 2021 predates FlashAttention; the (B, heads, 2,048, 2,048) scores
  are written to memory;
- ``fused_softmax=True``: Megatron-LM's fused scale-mask-softmax kernel (``--masked-softmax-fusion``,
  on by default, ``arguments.py``);
- ``attention_dropout=0.1``: ``--attention-dropout`` defaults to 0.1 (``arguments.py``);
- ``fused_bias_dropout_add=True``: ``--bias-dropout-fusion``, on by default (``arguments.py``;
  the paper's section 4.2 describes the fused kernels);
- ``overlap_grad_reduce=False``: the data-parallel all-reduce ran after the backward; Megatron-LM
  added ``--overlap-grad-reduce`` in September 2023 (NVIDIA/Megatron-LM issues #391 and #456);
- the recipe: fp16 mixed precision as Megatron-LM's GPT scripts of 2021 ran it (``--fp16``): fp16
  weights and gradients, gradients all-reduced in fp16 (fp32 accumulation and reduction,
  ``--accumulate-allreduce-grads-in-fp32``, is off by default and forced only for bf16), fp32
  master weights and Adam moments, the dynamic loss scaler (unscale and infinity check before each
  step), the gradients' global norm clipped at 1.0 (``--clip-grad`` defaults to 1.0);
- the model: GPT's hidden states dropped with p = 0.1 after the attention and the MLP
  (``--hidden-dropout``), every transformer layer recomputed in the backward (the paper's runs use
  activation recomputation, ``--checkpoint-activations``), the layers split evenly over the
  pipeline stages (``num_layers // pipeline_model_parallel_size`` each, the embedding on the
  first, the output layer on the last), 1F1B.

The paper does not give the micro-batch size: the fastest that fits by nbscaler's own prediction
is used, and said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from nbscaler import Hardware, LossScaling, Recipe, Software
from nbscaler.models.gpt import GPTConfig

MEGATRON_2021_SOFTWARE = Software(attention="materialized", attention_dropout=0.1, fused_softmax=True,
                                  fused_bias_dropout_add=True, overlap_grad_reduce=False, name="Megatron-LM 2021")
MEGATRON_2021_RECIPE = Recipe(torch.optim.Adam, module_dtype=torch.float16, master_dtype=torch.float32,
                              grad_reduce_dtype=torch.float16, loss_scaling=LossScaling(), clip_grad_norm=1.0)


@dataclass(frozen=True)
class RunFacts:
    """How a run trained, beyond its shape and layout: each fact applied whichever way it moves the step."""

    software: Software
    recipe: Recipe
    hidden_dropout: float = 0.0
    recompute: str = "full"                 # every transformer layer recomputed in the backward
    pipeline_split: str = "layers"          # PipelineSplit: equal layers per stage
    scheduler: str = "1f1b"

    def replace(self, **changes) -> "RunFacts":
        return dataclasses.replace(self, **changes)


MEGATRON_2021 = RunFacts(MEGATRON_2021_SOFTWARE, MEGATRON_2021_RECIPE, hidden_dropout=0.1)


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published table: a GPT's shape, its layout, and TFLOP/s per GPU as published."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    vocab: int = 51200
    seq: int = 2048
    target: str = "A100-SXM-80GB"
    facts: RunFacts = MEGATRON_2021
    source: str = "Narayanan et al. 2021 (SC21), Table 1"

    @property
    def units(self) -> int:
        """Data-parallel replicas."""
        return self.gpus // (self.tp * self.pp)

    @property
    def per_replica(self) -> int:
        """Sequences each replica trains on in a step."""
        return self.batch // self.units

    @property
    def paper_flops(self) -> float:
        """The paper's FLOPs of one step (Narayanan et al. 2021, equation 3, with recomputation):
        ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``."""
        b, s, l, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (16 * l * h))

    @property
    def published_step_s(self) -> float:
        """The step the published TFLOP/s per GPU implies."""
        return self.paper_flops / (self.tflops_per_gpu * 1e12 * self.gpus)

    def hardware(self, facts: Optional[RunFacts] = None) -> Hardware:
        """The run's GPUs running its software."""
        return Hardware.named(self.target, nodes=self.gpus // 8).running((facts or self.facts).software)

    def gpt(self, facts: Optional[RunFacts] = None) -> GPTConfig:
        """The row's GPT, its hidden states dropped as the run's were."""
        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq, n_layer=self.layers, d_model=self.hidden,
                         n_head=self.heads, dropout=(facts or self.facts).hidden_dropout)


#: Narayanan et al. 2021, Table 1 (and Megatron-LM's README of 2021): every row.
NARAYANAN_2021 = [
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
