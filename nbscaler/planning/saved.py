"""A ``Plan`` read back from a folder of generated files, for views and reports without the model.

``parallelize`` writes ``config.json`` (the compute config, the policy's name, the module's name)
and ``graph.pkl`` (the placed and costed graphs) next to the generated code; together they are the
plan. Nothing is traced again, no module is built, and the graphs are read through
``nbscaler.safeload``, so a file that could run code is refused:

>>> p = load_plan(".nbscaler/_parallel_modules/tests.models.Llama/_")        # doctest: +SKIP
>>> p.summary()                                                              # doctest: +SKIP

A built-in policy comes back by name, so ``p.replan(...)`` works; a custom policy function does
not (pass ``policy=`` to ``replan``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Union

from nbscaler.cost.annotate import COST_KEYS, annotate_costs
from nbscaler.genfiles import CONFIG_FILE, GRAPH_FILE, GenDir
from nbscaler.planning.planner import Plan
from nbscaler.policy.builtin import POLICIES
from nbscaler.safeload import RefusedFile


class SavedPlanError(ValueError):
    """A folder that does not hold a complete, readable compile."""


def module_dirs(root: Union[str, Path]) -> List[Path]:
    """The generated-module folders at or under ``root`` (those with a ``config.json``)."""
    root = Path(root)
    if (root / CONFIG_FILE).exists():
        return [root]
    return sorted(p.parent for p in root.rglob(CONFIG_FILE) if (p.parent / GRAPH_FILE).exists())


def find_module_dir(root: Union[str, Path]) -> Path:
    """The one generated-module folder at or under ``root``, or an error that says which to pick."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist: give the folder parallelize wrote, "
                                "<gen_savedir>/_parallel_modules/<module>/<instance>.")
    found = module_dirs(root)
    if not found:
        raise SavedPlanError(f"{root} holds no compiled module (no {CONFIG_FILE} with a {GRAPH_FILE} beside it): "
                             "give the folder parallelize wrote, <gen_savedir>/_parallel_modules/<module>/<instance>.")
    if len(found) > 1:
        listing = "\n  ".join(str(p) for p in found)
        raise SavedPlanError(f"{root} holds {len(found)} compiled modules; name one of them:\n  {listing}")
    return found[0]


def load_plan(path: Union[str, Path]) -> Plan:
    """The ``Plan`` saved in a generated-module folder (or the only one under ``path``)."""
    folder = find_module_dir(path)
    gen = GenDir(folder)
    try:
        saved = gen.read_config()
        cfg = gen.compute_config()
        module = saved["fingerprint"]["graph"]["module"]
        policy = saved["policy"]
    except (KeyError, TypeError, ValueError) as e:
        raise SavedPlanError(f"{folder / CONFIG_FILE} is not a config parallelize wrote ({e!r}); compile again "
                             "with reuse='override'.") from e
    try:
        graphs = gen.read_graphs()
    except RefusedFile as e:
        raise SavedPlanError(str(e)) from e
    except OSError as e:
        raise SavedPlanError(f"{folder / GRAPH_FILE} cannot be read ({e!r}); parallelize leaves it out, with a "
                             "warning, when the graphs hold a type of the module's own. Compile again with "
                             "reuse='override'.") from e
    for graph in graphs.values():
        if any(key not in n.meta for n in graph.nodes for key in COST_KEYS):      # written before a fact was added
            annotate_costs(graph)
    return Plan(graphs, cfg, policy, module, saved.get("plan_seconds", 0.0),
                policy=policy if policy in POLICIES else None)
