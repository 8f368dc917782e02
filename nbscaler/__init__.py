"""nbscaler: turn a ``torch.nn.Module`` into a parallel module, and watch it work from a notebook."""

from nbscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType, UserConfig

__all__ = ["BroadcastGenFilesStrategy", "ComputeConfig", "ReuseType", "UserConfig"]
__version__ = "0.1.0"
