"""How a pass's tasks are dealt to its workers (`workers.Deal`)."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.checkpoint.workers import Deal


def dealt(tasks: int, jobs: int, runs: int, turns: list[int]) -> tuple[list[list[int]], list[int]]:
    """The tasks each of `jobs` workers takes, and all in the order taken, when they ask in the order of `turns`,
    then in turn till each is told there is none left (checking, each time, that none is)."""
    deal = Deal(tasks, runs, [0] * (2 * runs), threading.Lock())
    taken: list[list[int]] = [[] for _ in range(jobs)]
    log: list[int] = []
    done: set[int] = set()
    for k in [*turns, *list(range(jobs)) * (tasks + 1)]:
        k %= jobs
        if k in done:
            continue
        try:
            i = deal.take(k)
        except StopIteration:
            assert sorted(log) == list(range(tasks))  # never while a task is left
            done.add(k)
            continue
        taken[k].append(i)
        log.append(i)
    assert done == set(range(jobs))
    return taken, log


@settings(max_examples=300, deadline=None)
@given(tasks=st.integers(0, 120), jobs=st.integers(1, 8), turns=st.lists(st.integers(0, 7), max_size=200))
def test_every_task_is_taken_once_and_none_is_left_while_a_worker_stops(tasks, jobs, turns):
    for runs in (jobs, 1):
        _, log = dealt(tasks, jobs, runs, turns)
        assert sorted(log) == list(range(tasks))
        if runs == 1:  # (a store that reads ahead in the tasks' order): in that order, whoever asks
            assert log == list(range(tasks))


@given(tasks=st.integers(0, 120), jobs=st.integers(1, 8))
def test_workers_asking_in_turn_each_take_their_own_run_in_order_first(tasks, jobs):
    taken, _ = dealt(tasks, jobs, jobs, [])
    for k, worker in enumerate(taken):
        each, longer = divmod(tasks, jobs)
        first = k * each + min(k, longer)
        own = list(range(first, first + each + (k < longer)))
        assert worker[: len(own)] == own
    assert max(map(len, taken)) - min(map(len, taken)) <= 1  # and as many each, within one


def test_a_worker_done_takes_the_second_half_of_the_longest_run_left():
    deal = Deal(20, 4, [0] * 8, threading.Lock())  # runs 0-4, 5-9, 10-14, 15-19
    assert [deal.take(0) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert deal.take(3) == 15  # (its own)
    assert deal.take(0) == 7  # of 5-9 (the first of the longest): 5, 6 stay with worker 1
    assert [deal.take(1) for _ in range(2)] == [5, 6]
    assert deal.take(1) == 12  # its run is done: 10-14's second half
    assert [deal.take(0), deal.take(0)] == [8, 9]
