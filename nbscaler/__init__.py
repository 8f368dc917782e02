"""nbscaler: turn a ``torch.nn.Module`` into a parallel module, and watch it work from a notebook.

>>> from nbscaler import parallelize, ComputeConfig, build_optimizer      # doctest: +SKIP
>>> pm = parallelize(model, {'x': x}, 'tp', ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
"""

from nbscaler.config import BroadcastGenFilesStrategy, ComputeConfig, RecomputeGranularity, ReuseType, UserConfig
from nbscaler.cost.hardware import Hardware, NumberFormat
from nbscaler.cost.software import AttentionKind, Software
from nbscaler.ir.registry import register_op
from nbscaler.cost.optimizers import register_optimizer
from nbscaler.parallel import parallelize, plan
from nbscaler.planning import Plan
from nbscaler.recipe import LossScaling, Recipe
from nbscaler.space import PlanSpace, sweep
from nbscaler.runtime.checkpoint import load_merged_state_dicts, merge_state_dicts
from nbscaler.runtime.distributed import DistributedInfo, init_distributed
from nbscaler.runtime.module import ParallelModule
from nbscaler.runtime.optimizer import build_optimizer
from nbscaler.runtime.replicas import broadcast_weights, deduped_state_dict, load_deduped_state_dict

__all__ = ["BroadcastGenFilesStrategy", "ComputeConfig", "ParallelModule", "RecomputeGranularity", "ReuseType", "UserConfig",
           "DistributedInfo", "broadcast_weights", "build_optimizer", "deduped_state_dict", "Hardware",
           "init_distributed", "load_deduped_state_dict", "load_merged_state_dicts", "merge_state_dicts",
           "LossScaling", "NumberFormat", "parallelize", "Plan", "PlanSpace", "plan", "Recipe", "register_op",
           "register_optimizer", "sweep", "Software", "AttentionKind"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Former names that still resolve, with a warning (``nbscaler.cost.hardware.FORMER_NAMES``)."""
    from nbscaler.cost.hardware import former_name
    return former_name(name, __name__)
