"""Pipeline schedules as plain data: which (stage, micro-batch, forward|backward) blocks each device runs, in order."""

from nbscaler.schedule.block import PHASES, Block, Phase
from nbscaler.schedule.pipeline import PipelineSchedule, Placement, check_samples

__all__ = ["Block", "PHASES", "Phase", "PipelineSchedule", "Placement", "check_samples"]
