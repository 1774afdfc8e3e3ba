"""Random order (reference E2 `random`), seeded from `model.random_seed` for reproducible runs."""

import random as _random

from framework import hookimpl
from framework.request import StashKey

PLUGIN_KIND = "policy"

_RNG_KEY: StashKey[_random.Random] = StashKey("random_policy_rng")


@hookimpl
def select_prefill(view):
    rng = view.stash.setdefault(_RNG_KEY, _random.Random(view.settings.model.random_seed))
    order = list(view.waiting_queue)
    rng.shuffle(order)
    return order
