"""DFS by subtree weight (reference E2 `dfs-weight`).

Requests are grouped by the cache node their matched prefix ends at. A node's weight is the number
of requests ending there plus its children's weights. The queue is rebuilt by a depth-first walk
from the root that visits heavier children first and appends a node's own requests after its
children (post-order), so requests sharing long prefixes run together.
"""

from __future__ import annotations

from framework import hookimpl
from plugins.policies.lpm import fcfs_when_no_sharing, match_all

PLUGIN_KIND = "policy"
PLUGIN_NAME = "dfs-weight"


def dfs_order(root, reqs) -> list:
    by_node: dict[int, list] = {}
    for req in reqs:
        by_node.setdefault(id(req.last_node), []).append(req)
    weight: dict[int, int] = {}

    def calc_weight(node) -> int:
        w = len(by_node.get(id(node), ()))
        for child in node.children.values():
            w += calc_weight(child)
        weight[id(node)] = w
        return w

    calc_weight(root)
    order: list = []

    def visit(node) -> None:
        children = sorted(node.children.values(), key=lambda c: -weight[id(c)])
        for child in children:
            visit(child)
        order.extend(by_node.get(id(node), ()))

    visit(root)
    return order


@hookimpl
def select_prefill(scheduler, adder):
    queue = scheduler.waiting_queue
    if fcfs_when_no_sharing(scheduler, PLUGIN_NAME):
        return adder.admit_waiting(scheduler, list(queue), prefix_computed=False)
    match_all(scheduler)
    queue[:] = dfs_order(scheduler.tree_cache.root_node, queue)
    return adder.admit_waiting(scheduler, list(queue), prefix_computed=True)
