"""The graph view: the IR graph of a plan, collapsed by module and laid out one visible level at a time.

- ``tree``: the module hierarchy and what an expansion shows;
- ``box``: one box of a pane (a module, an op, the inputs or outputs);
- ``facts``: what the view reads from the plan, once per plan, and the boxes it makes;
- ``scene``: one pane at one expansion (boxes, frames, edges and their bytes);
- ``layout``: graphviz ``dot`` positions for a scene, cached;
- ``svg``: the drawing; ``details``: the panel of a selected op;
- ``model`` and ``view``: the state and the widget (``GraphView``).
"""

from nbscaler.widgets.graph.view import GraphView

__all__ = ["GraphView"]
