"""Make torchvision importable beside a torch its C++ library was not built for.

torchvision's wheel on PyPI is built against a CUDA torch, so beside the CPU torch its ``_C``
library fails to load (``libtorch_cuda.so`` is missing). torchvision then runs without its C++ ops,
except that importing it still registers fake kernels for ``nms`` and ``qnms`` (the other ops'
registrations first ask whether the library loaded), which fails because those ops were never
declared. transformers and timm import torchvision whenever it is installed, so they fail too.

Only detection models call those ops; the classification models and the language models nbscaler
plans are plain Python over torch ops. So where the library does not load, ``declare_missing_ops``
declares the two ops (with the schemas the library gives them, and no kernel: calling them still
fails) before anything imports torchvision. Where torchvision matches torch its library loads and
nothing is declared.
"""

from __future__ import annotations

import importlib.util
import pathlib
import torch

# The ops torchvision's ``_meta_registrations`` registers fake kernels for without asking whether
# its C++ library loaded, as that library declares them.
UNGUARDED_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_declared: list = []        # the torchvision op namespace the ops are declared in, kept alive


def declare_missing_ops() -> bool:
    """Declare ``UNGUARDED_OPS`` if torchvision is installed and its C++ library cannot load.
    Returns whether they are declared (now or before). Cheap to call again."""
    if _declared:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _library_loads(pathlib.Path(spec.origin).parent):
        return False
    namespace = torch.library.Library("torchvision", "FRAGMENT")
    for signature in UNGUARDED_OPS:
        namespace.define(signature)      # no kernel: classification models, which never call it, trace
    _declared.append(namespace)
    return True


def _library_loads(package: pathlib.Path) -> bool:
    """Whether torchvision's C++ op library loads beside this torch (it is then loaded)."""
    if hasattr(torch.ops.torchvision, "nms"):
        return True
    for shared_object in package.glob("_C*.so"):
        try:
            torch.ops.load_library(str(shared_object))
        except (OSError, RuntimeError):
            return False
        return True
    return False
