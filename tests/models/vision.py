"""Vision models nobody here wrote, built as their users build them, at toy sizes.

- torchvision's ResNet-18 and MobileNetV3-small (``torchvision.models.resnet18``,
  ``mobilenet_v3_small``) on 3x32x32 images: BatchNorm, ``max_pool2d``, ``adaptive_avg_pool2d``,
  ``hardswish``, ``hardsigmoid``, depthwise (grouped) convolutions, squeeze-and-excitation and
  residual shortcuts with a strided 1x1 projection.
- timm's ``VisionTransformer`` (two blocks, 4 heads of 8, 8x8 patches of a 32x32 image): a patch
  convolution, a class token, learned position embeddings and a fused qkv projection.

The CNNs run in float64: at 32x32 their last BatchNorms see 1x1 maps, so each channel's batch
variance comes from a handful of numbers, and float32 rounding of it (a different summation order
on a split batch) is amplified past the 1e-5 tolerance: in float32 even ``dp`` on two ranks differs
from one process by 7e-4 (ResNet-18, second step) and 4e-5 (MobileNetV3, first step). The ViT
(LayerNorm only) runs in float32. Dropout is off so that every run computes the same thing.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler.models import torchvision_compat

CLASSES = 4
IMAGE = 32


def import_torchvision() -> ModuleType:
    """``import torchvision``, or an error that says how to install it."""
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError("torchvision is not installed: run `make setup` (torchvision and timm for the "
                          "vision-model tests, with the CPU torch kept).")
    torchvision_compat.declare_missing_ops()
    import torchvision
    return torchvision


def resnet18() -> nn.Module:
    return import_torchvision().models.resnet18(num_classes=CLASSES)


def mobilenet_v3_small() -> nn.Module:
    return import_torchvision().models.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0)


def vit() -> nn.Module:
    import_torchvision()                        # timm imports torchvision when it is installed
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=IMAGE, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0,
                             num_classes=CLASSES)


class Classifier(nn.Module):
    """``forward(batch) -> cross-entropy loss`` of a network that returns logits, as a training
    loop computes it; one argument, so the same module is end2end for pipelines."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["x"]), batch["y"])


BUILDERS: Dict[str, Callable[[], nn.Module]] = {
    "resnet": lambda: Classifier(resnet18()).double(),
    "mobilenet": lambda: Classifier(mobilenet_v3_small()).double(),
    "vit": lambda: Classifier(vit()),
}
DTYPES = {"resnet": torch.float64, "mobilenet": torch.float64, "vit": torch.float32}


def batch(name: str, g: torch.Generator, batch_size: int = 4) -> dict:
    return {"batch": {"x": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g, dtype=DTYPES[name]),
                      "y": torch.randint(0, CLASSES, (batch_size,), generator=g)}}
