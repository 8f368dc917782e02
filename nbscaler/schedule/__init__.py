"""Pipeline schedules as plain data: which (stage, micro-batch, forward|backward) blocks each device runs, in order."""

from nbscaler.schedule.block import PHASES, Block, Phase
from nbscaler.schedule.pipeline import PipelineSchedule, Placement, check_samples
from nbscaler.schedule.schedulers import SCHEDULERS, build_schedule, register_scheduler

__all__ = [
    "Block", "PHASES", "Phase", "PipelineSchedule", "Placement", "SCHEDULERS", "build_schedule",
    "check_samples", "register_scheduler",
]
