"""Code generation: one readable Python module per rank, and the folder that holds them."""

from nbscaler.codegen.rankfile import generate
from nbscaler.codegen.render import CodegenError
from nbscaler.codegen.store import GenDir, module_dir

__all__ = ["CodegenError", "GenDir", "generate", "module_dir"]
