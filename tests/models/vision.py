"""Convolutional networks written like torchvision's ResNet and MobileNetV3, at toy sizes.

They cover what those families call: BatchNorm, ``max_pool2d``, ``adaptive_avg_pool2d``,
``hardswish``, ``hardsigmoid``, depthwise (grouped) convolutions, squeeze-and-excitation and
residual shortcuts with a strided 1x1 projection.

``resnet`` runs in float64: BatchNorm on 4x4 maps divides by a batch variance from 32 numbers per
channel, and float32 rounding of that (different summation orders on split batches) is amplified
past the 1e-5 tolerance over three steps. ``mobilenet`` is the same story with its depthwise blocks.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 4


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs with BatchNorm, and a projected shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """Stem (conv, BatchNorm, ReLU, max pool), two stages of basic blocks, global average pool, fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), kernel_size=2)      # (B, 8, 4, 4)
        x = self.layer2(self.layer1(x))                                       # (B, 16, 2, 2)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)                     # (B, 16)
        return self.fc(x)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeeze: int):
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand, depthwise 3x3, squeeze-excite, 1x1 project; hardswish."""

    def __init__(self, c: int, expand: int):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(expand, expand, 3, 1, 1, groups=expand, bias=False),
                                       nn.BatchNorm2d(expand), nn.Hardswish())
        self.se = SqueezeExcite(expand, 8)
        self.project = nn.Sequential(nn.Conv2d(expand, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class MobileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.block = InvertedResidual(8, 16)
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.Hardswish(), nn.Linear(16, CLASSES))

    def forward(self, x):
        x = self.block(self.stem(x))                                          # (B, 8, 4, 4)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


class Classifier(nn.Module):
    """``forward(batch) -> cross-entropy loss`` of a network that returns logits, as a training
    loop computes it; one argument, so the same module is end2end for pipelines."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["x"]), batch["y"])


BUILDERS: Dict[str, Callable[[], nn.Module]] = {
    "resnet": lambda: Classifier(ResNet()).double(),
    "mobilenet": lambda: Classifier(MobileNet()).double(),
}


def batch(name: str, g: torch.Generator, batch_size: int = 4) -> dict:
    return {"batch": {"x": torch.randn(batch_size, 3, 8, 8, generator=g, dtype=torch.float64),
                      "y": torch.randint(0, CLASSES, (batch_size,), generator=g)}}
