"""Communication: tensor layouts across devices, the collectives that convert between them, and the
lowering of a placed plan into one program per rank (``comm.lower``, ``comm.program``), with the
arguments each rank calls an op with (``comm.arguments``)."""

from nbscaler.comm.layout import Layout, Step, conversion, input_requirement, output_layout
from nbscaler.comm.lower import lower
from nbscaler.comm.program import RankProgram

__all__ = ["Layout", "RankProgram", "Step", "conversion", "input_requirement", "lower", "output_layout"]
