"""The in-process `Engine`'s contract with its caller: bad arguments are ValueErrors naming the
field before anything is queued, an interrupted call (Ctrl-C, a timeout's signal) leaves the
Engine idle and whole, and a shut-down Engine refuses work. Every engine here is leak-checked
after its test (`make_engine`)."""

from __future__ import annotations

import signal

import pytest

PARAMS = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, whatever the run inherited: a test suite started
    in the background by a non-interactive shell ignores SIGINT, and then no Ctrl-C reaches the
    Engine (as it should not)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)

BAD_CALLS = {
    "stop a number": (dict(prompt="hi", sampling_params={**PARAMS, "stop": 5}), "sampling_params.stop: must be"),
    "stop ids": (dict(prompt="hi", sampling_params={**PARAMS, "stop": [1, 2]}), "sampling_params.stop: must be"),
    "ignore_eos a string": (dict(prompt="hi", sampling_params={**PARAMS, "ignore_eos": "no"}),
                            "sampling_params.ignore_eos: must be true or false"),
    "skip_special_tokens 1": (dict(prompt="hi", sampling_params={**PARAMS, "skip_special_tokens": 1}),
                              "sampling_params.skip_special_tokens: must be true or false"),
    "sampling_params a string": (dict(prompt="hi", sampling_params="max_new_tokens=4"),
                                 "sampling_params: must be a dict"),
    "prompt a number": (dict(prompt=123, sampling_params=PARAMS), "prompt must be a string or a list of strings"),
    "input_ids floats": (dict(input_ids=[1.5, 2.0], sampling_params=PARAMS), "input_ids must be a list of integers"),
    "input_ids nested floats": (dict(input_ids=[[1, 2], [1.5]], sampling_params=PARAMS),
                                "input_ids must be a list of integers"),
    "return_logprob a string": (dict(prompt="hi", sampling_params=PARAMS, return_logprob="yes"),
                                "return_logprob: must be true or false"),
    "top_logprobs_num a string": (dict(prompt="hi", sampling_params=PARAMS, return_logprob=True,
                                       top_logprobs_num="x"), "top_logprobs_num: must be an integer"),
    "top_logprobs_num a float": (dict(prompt="hi", sampling_params=PARAMS, return_logprob=True,
                                      top_logprobs_num=2.5), "top_logprobs_num: must be an integer"),
    "top_logprobs_num negative": (dict(prompt="hi", sampling_params=PARAMS, return_logprob=True,
                                       top_logprobs_num=-3), "top_logprobs_num: must be >= 0"),
    "logprob_start_len a string": (dict(prompt="hi", sampling_params=PARAMS, return_logprob=True,
                                        logprob_start_len="a"), "logprob_start_len: must be an integer"),
    "logprob_start_len past the prompt": (dict(input_ids=[1, 2, 3], sampling_params=PARAMS, return_logprob=True,
                                               logprob_start_len=3), "logprob_start_len: must be < the prompt length"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_argument_is_a_value_error_naming_it_and_nothing_is_queued(make_engine, case):
    kwargs, message = BAD_CALLS[case]
    engine = make_engine()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        engine.generate(**kwargs)
    assert not engine.scheduler.has_work() and not engine._outputs
    assert engine.generate("fine", PARAMS)["meta_info"]["finish_reason"]["type"] == "length"


def test_an_interrupt_inside_an_iteration_waits_for_its_end_and_leaves_the_engine_whole(make_engine,
                                                                                           default_sigint):
    """The signal arrives in the middle of an iteration (here: as the worker starts a batch), as a
    Ctrl-C or an alarm would. Its KeyboardInterrupt is raised once the iteration is over, the
    interrupted requests are aborted and released, and the next call runs on a clean Engine (the
    fixture's leak check and `check_leaks` would catch a slot left behind)."""
    engine = make_engine(scheduler={"check_leaks": True})
    worker = engine.scheduler.worker
    launch = worker.launch
    calls = []

    def interrupted_launch(batch):
        calls.append(len(calls))
        if len(calls) == 2:  # the first decode step, with KV already allocated for it
            signal.raise_signal(signal.SIGINT)
        return launch(batch)

    worker.launch = interrupted_launch
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(["Tell me a story", "Why is the sky blue"], {**PARAMS, "max_new_tokens": 16})
    finally:
        worker.launch = launch
    assert len(calls) >= 2
    assert not engine.scheduler.has_work() and not engine._outputs
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    out = engine.generate("The capital of France is", PARAMS)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_an_interrupt_while_the_requests_are_queued_leaves_none_behind(make_engine):
    """Ctrl-C as a call queues its prompts (before its first iteration): the ones already queued
    are aborted too, so the next call runs only its own and none stay in memory."""
    engine = make_engine(scheduler={"check_leaks": True})
    send = engine.scheduler.send
    sent = []

    def interrupted_send(message):
        sent.append(message)
        if len(sent) == 3:
            raise KeyboardInterrupt
        send(message)

    engine.scheduler.send = interrupted_send
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate([f"prompt {i}" for i in range(5)], PARAMS)
    finally:
        engine.scheduler.send = send
    assert not engine.scheduler.has_work() and not engine._outputs
    outs = engine.generate(["all is well"], PARAMS)
    assert len(outs) == 1 and not engine._outputs and not engine.scheduler.has_work()


def test_a_second_interrupt_inside_an_iteration_raises_at_once(tiny_model_folder, default_sigint):
    """Ctrl-C pressed again while an iteration runs (a hung plugin, a long prefill) is not held
    back: the caller insists. The Engine's handlers are the caller's again after the call."""
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    before = signal.getsignal(signal.SIGINT)
    engine = Engine(tiny_settings(tiny_model_folder))
    reached = []

    def launch_interrupted_twice(batch):
        signal.raise_signal(signal.SIGINT)
        reached.append("after the first")
        signal.raise_signal(signal.SIGINT)
        reached.append("after the second")

    engine.scheduler.worker.launch = launch_interrupted_twice
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate("hi", PARAMS)
        assert reached == ["after the first"]
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        engine.shutdown()


def test_a_shut_down_engine_refuses_work(make_engine):
    engine = make_engine()
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi", PARAMS)
    for call in (engine.flush_cache, engine.start_profile, engine.stop_profile,
                 lambda: engine.update_weights_from_disk("x"), lambda: engine.encode("hi")):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_encode_names_the_inputs_it_takes(make_engine):
    with pytest.raises(ValueError, match=r"^give exactly one of prompt or input_ids$"):
        make_engine().encode()


def test_calls_from_several_threads_take_turns_and_each_gets_its_own_results(make_engine):
    """A thread pool sharing one Engine: each call steps the scheduler alone (the others wait)
    and gets the outputs of its own prompts, in order, as a call made alone would."""
    import threading
    import time

    engine = make_engine(scheduler={"check_leaks": True})
    batches = [[f"thread {i} prompt {j}" for j in range(4)] for i in range(3)]
    alone = [[out["output_ids"] for out in engine.generate(prompts, PARAMS)] for prompts in batches]
    run_once = engine.scheduler.run_once
    inside, most_inside = [], []

    def slow_run_once():
        inside.append(1)
        most_inside.append(len(inside))
        time.sleep(0.002)  # room for another thread to step in, were it let in
        try:
            return run_once()
        finally:
            inside.pop()

    engine.scheduler.run_once = slow_run_once
    results, errors = {}, []

    def job(i):
        try:
            results[i] = [out["output_ids"] for out in engine.generate(batches[i], PARAMS)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and max(most_inside) == 1
    assert [results[i] for i in range(len(batches))] == alone


def test_input_ids_as_numpy_arrays_or_tensors_are_token_lists(make_engine):
    """A batch job's ids often come as numpy arrays or torch tensors: taken as their integers
    (they were refused as "not a list of integers"); float arrays are still refused."""
    import numpy as np
    import torch

    engine = make_engine()
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    want = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=PARAMS)]
    as_arrays = [np.array(x, dtype=np.int64) for x in ids]
    assert [o["output_ids"] for o in engine.generate(input_ids=as_arrays, sampling_params=PARAMS)] == want
    assert engine.generate(input_ids=torch.tensor(ids[0]), sampling_params=PARAMS)["output_ids"] == want[0]
    assert engine.generate(input_ids=[np.int32(t) for t in ids[1]], sampling_params=PARAMS)["output_ids"] == want[1]
    with pytest.raises(ValueError, match="input_ids must be a list of integers"):
        engine.generate(input_ids=np.array([1.5, 2.0]), sampling_params=PARAMS)
