"""Code generation: each rank's lowered program (``comm.lower``) printed as one readable Python module
(the folder that holds them is ``nbscaler.genfiles``)."""

from nbscaler.codegen.rankfile import generate
from nbscaler.codegen.render import CodegenError

__all__ = ["CodegenError", "generate"]
