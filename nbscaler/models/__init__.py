"""Example models shipped with nbscaler, used by the demo, the benchmarks and the notebooks."""
