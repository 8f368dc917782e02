"""Code generation: one readable Python module per rank (the folder that holds them is ``nbscaler.genfiles``)."""

from nbscaler.codegen.rankfile import generate
from nbscaler.codegen.render import CodegenError

__all__ = ["CodegenError", "generate"]
