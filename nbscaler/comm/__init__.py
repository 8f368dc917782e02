"""Communication: tensor layouts across devices, and the collectives that convert between them."""

from nbscaler.comm.layout import Layout, Step, conversion, input_requirement, output_layout

__all__ = ["Layout", "Step", "conversion", "input_requirement", "output_layout"]
