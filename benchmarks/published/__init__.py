"""Published training runs beside nbscaler's predictions of them (``python -m benchmarks.published_runs``).

- ``runs``: each run as published, with the facts of its run (software, recipe, recompute, split);
- ``predict``: a run planned on meta and priced on its target, each fact undone alone;
- ``report``: the results file, every figure and verdict computed from the predictions.
"""
