"""nbscaler: turn a ``torch.nn.Module`` into a parallel module, and watch it work from a notebook.

>>> from nbscaler import parallelize, ComputeConfig, build_optimizer      # doctest: +SKIP
>>> pm = parallelize(model, {'x': x}, 'tp', ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
"""

from nbscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType, UserConfig
from nbscaler.ir.registry import register_op
from nbscaler.parallel import parallelize
from nbscaler.runtime.module import ParallelModule
from nbscaler.runtime.optimizer import build_optimizer

__all__ = ["BroadcastGenFilesStrategy", "ComputeConfig", "ParallelModule", "ReuseType", "UserConfig",
           "build_optimizer", "parallelize", "register_op"]
__version__ = "0.1.0"
