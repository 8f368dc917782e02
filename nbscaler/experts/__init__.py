"""Routed experts: each token's hidden state goes through the ``top_k`` SwiGLU experts its router
chose, and their outputs are added up, weighted by the router.

The experts' weights are batched, ``(E, d, h)`` and ``(E, h, d)``, as Hugging Face and torchtitan
store them. Two ways of routing, both with shapes fixed by the input's (so they trace on shapes
alone, and the plan holds for any routing, not only the one seen when tracing):

- **dropless** (``dropless_experts``): every token is served. The ``B*T*k`` (token, expert) pairs
  are sorted by expert, each expert multiplies its run of rows (``grouped_mm``, PyTorch's grouped product,
  with the runs' ends as offsets: one per weight), and the rows are added back to their
  tokens. How many rows each expert gets depends on the routing, the total never does.
- **capacity** (``capacity_experts``): each expert serves at most ``capacity`` pairs of each
  sequence, in token order; the pairs beyond it are dropped (they add nothing). The pairs are
  placed in an ``(E, B*capacity, d)`` buffer and every expert multiplies all its slots, used or
  not (``torch.bmm``): a fixed amount of work, as a GShard-style layer does.

Both are one op of nbscaler's graph (``register_op``) with one axis a policy may split: the tokens
``n`` (dropless) or the sequences ``b`` (capacity), each device routing its own through every
expert, whose weights it holds whole and whose gradients are summed over the devices. Capacity is
counted per sequence so that splitting the batch changes nothing of what is dropped. Tensor
parallelism splits the experts' hidden width ``h``; expert parallelism splits the experts
themselves, the pairs travelling to them inside the op (``nbscaler.experts.parallel``).

Hugging Face's expert modules are recorded as ``dropless_experts`` (``nbscaler.experts.huggingface``),
so every split of the op applies to them too.
"""

from nbscaler.experts.grouped import grouped_mm
from nbscaler.experts.log import CapacityOverflowWarning, RoutingLog
from nbscaler.experts.routing import capacity_experts, dropless_experts

__all__ = ["CapacityOverflowWarning", "RoutingLog", "capacity_experts", "dropless_experts", "grouped_mm"]
