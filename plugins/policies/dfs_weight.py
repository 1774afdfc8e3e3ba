"""DFS by subtree weight (reference E2 `dfs-weight`).

Requests are grouped by the cache node their matched prefix ends at. A node's weight is the number
of requests ending there plus its children's weights. The queue is rebuilt by a depth-first walk
from the root that visits heavier children first and appends a node's own requests after its
children (post-order), so requests sharing long prefixes run together.
"""

from __future__ import annotations

from framework import hookimpl
from plugins.policies.lpm import fcfs_when_no_sharing

PLUGIN_KIND = "policy"


def dfs_order(root, reqs, node_of) -> list:
    by_node: dict[int, list] = {}
    for req in reqs:
        by_node.setdefault(id(node_of[id(req)]), []).append(req)
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
def select_prefill(view):
    queue = view.waiting_queue
    if fcfs_when_no_sharing(view, "dfs-weight"):
        return list(queue)
    node_of = {id(req): view.match_prefix(req).node for req in queue}
    return dfs_order(view.cache_root, queue, node_of)
