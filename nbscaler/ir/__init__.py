"""The intermediate representation: graph, tensors, dimension annotations and the op registry."""

from nbscaler.ir.annotation import AnnotationError, OpAnnotation
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, Placement
from nbscaler.ir.registry import register_op

__all__ = ["AnnotationError", "IRGraph", "IRNode", "IRTensor", "OpAnnotation", "Placement", "register_op"]
