"""Run generated code: the parallel module, differentiable collectives, reducers and launch."""
