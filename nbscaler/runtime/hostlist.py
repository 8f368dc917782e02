"""Slurm's compressed lists: hosts (``node[01-04,07]``) and tasks per node (``2(x3),1``).

Slurm writes the hosts of a job, ``SLURM_JOB_NODELIST``, as a comma-separated list whose items may
hold bracketed ranges and numbers; a range keeps the zero padding of its bounds. It writes how many
tasks each node runs, ``SLURM_TASKS_PER_NODE``, as counts with repeats.

>>> expand_hostlist("node[01-03,07],login")
['node01', 'node02', 'node03', 'node07', 'login']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
"""

from __future__ import annotations

import re
from typing import List


def _top_level_items(text: str) -> List[str]:
    """``text`` cut at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in the host list {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in the host list {text!r}")
    items.append(text[start:])
    return [item for item in (i.strip() for i in items) if item]


def _numbers(ranges: str, hostlist: str) -> List[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``, each as wide as its range's first bound."""
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{part!r} in the host list {hostlist!r} is not a number or a range 'a-b'")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1))
    return out


def expand_hostlist(hostlist: str) -> List[str]:
    """Every host of a Slurm host list, in its order (``node[1-2]x[3-4]`` gives four hosts)."""
    hosts: List[str] = []
    for item in _top_level_items(hostlist):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        head, ranges, tail = match.groups()
        rests = expand_hostlist(tail) if tail else [""]
        hosts.extend(head + number + rest for number in _numbers(ranges, hostlist) for rest in rests)
    return hosts


def expand_tasks_per_node(counts: str) -> List[int]:
    """The task count of every node, in node order, from Slurm's ``2(x3),1``."""
    out: List[int] = []
    for item in _top_level_items(counts):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise ValueError(f"{item!r} in the tasks per node {counts!r} is not 'n' or 'n(xk)'")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out
