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
    # Iterative walks: a radix tree can be deeper than Python's recursion limit (a node per turn
    # of a long session), and the cache itself never recurses.
    preorder, stack = [], [root]
    while stack:
        node = stack.pop()
        preorder.append(node)
        stack.extend(node.children.values())
    weight: dict[int, int] = {}
    for node in reversed(preorder):  # children before their parent
        weight[id(node)] = len(by_node.get(id(node), ())) + sum(weight[id(c)] for c in node.children.values())

    order: list = []
    pending = [(root, False)]
    while pending:
        node, children_done = pending.pop()
        if children_done:
            order.extend(by_node.get(id(node), ()))
            continue
        pending.append((node, True))
        children = sorted(node.children.values(), key=lambda c: -weight[id(c)])
        pending.extend((child, False) for child in reversed(children))  # heaviest popped first
    return order


@hookimpl
def select_prefill(view):
    queue = view.waiting_queue
    if fcfs_when_no_sharing(view, "dfs-weight"):
        return list(queue)
    node_of = {id(req): view.match_prefix(req).node for req in queue}
    return dfs_order(view.cache_root, queue, node_of)
