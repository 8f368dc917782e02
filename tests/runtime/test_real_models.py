"""Models nobody here wrote train like one process under every built-in policy.

transformers' Llama, Qwen2, Mistral, Mixtral, GPT-2 and BERT (tiny configs, random weights),
torchvision's ResNet-18 and MobileNetV3-small and a timm ViT (``tests.models.vision``), each under ``dp``, ``tp``, ``data`` and a two-stage
``1f1b`` pipeline on 2 ranks: losses, merged gradients and final parameters over 3 steps equal
one process's (``tests.multiprocess.check_equivalence``).
"""

import pytest
import torch

from nbscaler.models import torchvision_compat
from tests.models.vision import import_torchvision
from tests.multiprocess import Case, check_equivalence, pipeline, run_ranks, train_parallel

TRANSFORMERS = ["hf_llama", "hf_qwen2", "hf_mistral", "hf_mixtral", "hf_gpt2", "hf_bert"]
VISION = ["resnet", "mobilenet", "vit"]


def cases(model: str):
    return [Case(model, "dp", 1, 2), Case(model, "tp", 2, 2), Case(model, "data", 2, 2),
            Case(model, "pp", 2, 2, config=pipeline("1f1b", 2, 2))]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", TRANSFORMERS + VISION)
def test_real_models_equal_single_process(model, tmp_path):
    todo = cases(model)
    per_rank = run_ranks(train_parallel, 2, todo, str(tmp_path), timeout=600)
    for i, case in enumerate(todo):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_real_models_on_four_ranks(tmp_path):
    """One head per device for GPT-2 under tp, one sample per device for BatchNorm under data."""
    todo = [Case("hf_gpt2", "tp", 4, 4), Case("resnet", "data", 4, 4), Case("hf_llama", "tp", 2, 4)]
    per_rank = run_ranks(train_parallel, 4, todo, str(tmp_path), timeout=600)
    for i, case in enumerate(todo):
        check_equivalence(case, [res[i] for res in per_rank])


def test_torchvision_ops_are_declared_only_where_its_library_does_not_load():
    """A torchvision built for this torch keeps its own ops; one built for another (PyPI's CUDA
    wheel beside the CPU torch) gets the two declarations its import needs, and nothing else."""
    torchvision = import_torchvision()
    assert torchvision_compat.declare_missing_ops() == (not torchvision.extension._has_ops())
    assert torchvision.models.resnet18(num_classes=2)(torch.randn(2, 3, 32, 32)).shape == (2, 2)
