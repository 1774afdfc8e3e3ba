"""Scheduling under KV pressure on the fake worker: retracted requests come back and finish."""

from __future__ import annotations

from framework.testing import SchedulerHarness


def test_a_request_retracted_late_is_readmitted_and_finishes():
    """A long request retracted after many outputs must fit the pool again once it drains: it was
    budgeted as prompt + outputs + all of max_new_tokens (> the pool) and waited forever."""
    with SchedulerHarness(cache={"max_total_tokens": 512},
                          scheduler={"init_new_token_ratio": 0.001, "chunked_prefill_size": 0}) as h:
        first = h.add([5] * 10, max_new_tokens=400, ignore_eos=True)
        h.step()
        # Admitted beside `first` by the tiny ratio; it has fewer outputs, so it is the victim.
        late = h.add(list(range(100, 200)), max_new_tokens=380, ignore_eos=True)
        h.run(max_steps=2000)
        assert h.scheduler.num_retractions == 1
        assert h.finished == {first: h.finished[first], late: h.finished[late]}
        assert (len(h.outputs[first]), len(h.outputs[late])) == (400, 380)
        h.check_no_leak()
