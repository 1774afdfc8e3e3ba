"""Random order (reference E2 `random`), seeded from `model.random_seed` for reproducible runs."""

import random as _random

from framework import hookimpl
from framework.request import StashKey

PLUGIN_KIND = "policy"
PLUGIN_NAME = "random"

_RNG_KEY: StashKey[_random.Random] = StashKey("random_policy_rng")


@hookimpl
def select_prefill(scheduler, adder):
    rng = scheduler.stash.setdefault(_RNG_KEY, _random.Random(scheduler.settings.model.random_seed))
    queue = scheduler.waiting_queue
    rng.shuffle(queue)
    return adder.admit_waiting(scheduler, list(queue), prefix_computed=False)
