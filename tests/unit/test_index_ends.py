import random

import numpy as np
import pytest

from extproc.index.approx import ApproxPrefixIndex
from extproc.index.ends import WINDOW_BLOCKS, PromptEnds
from extproc.index.precise import PreciseIndex


def test_a_held_run_continues_a_prompt_that_ended_within_the_window():
    ends = PromptEnds()
    ends.note([1, 2, 3, 4])  # a conversation's first turn
    turn = [1, 2, 3, 4, 5, 6]
    assert ends.continues(turn, 4)  # the next turn holds the whole first prompt
    assert not ends.continues(turn, 3)  # a run ending before that prompt's end branches off it
    assert not ends.continues(turn, 0)
    # The pod also cached the reply: the run reaches past the prompt's end, up to the window.
    long = [1, 2, 3, 4, *range(100, 100 + 2 * WINDOW_BLOCKS)]
    assert ends.continues(long, 4 + WINDOW_BLOCKS - 1)
    assert not ends.continues(long, 4 + WINDOW_BLOCKS)


def test_a_shared_prefix_that_prompts_branch_off_is_not_continued():
    ends = PromptEnds()
    system = list(range(10, 26))
    for user in range(3):  # three conversations on one system prompt
        ends.note([*system, 1000 + user, 2000 + user])
    assert not ends.continues([*system, 3000, 3001], len(system))


def test_the_oldest_ends_are_forgotten_first_and_a_renewed_one_is_kept():
    ends = PromptEnds(capacity=2)
    ends.note([1])
    ends.note([2])
    ends.note([1])  # renewed: now the newest
    ends.note([3])
    assert len(ends) == 2
    assert ends.continues([1], 1) and ends.continues([3], 1) and not ends.continues([2], 1)
    ends.note([])
    assert len(ends) == 2
    with pytest.raises(ValueError):
        PromptEnds(capacity=0)


def test_a_long_run_keeps_every_one_of_the_newest_ends_and_forgets_the_old():
    """Against a plain list of the newest distinct keys (by their latest note): many renewals and
    rotations, each of the newest ``capacity`` held at every step, never more than twice as many."""
    rng = random.Random(7)
    ends, newest = PromptEnds(capacity=50), []
    for _ in range(5000):
        k = rng.randrange(200)
        ends.note([1000 + k])
        if k in newest:
            newest.remove(k)
        newest.append(k)
        del newest[:-50]
        assert len(ends) <= 100
        assert all(ends.continues([1000 + n], 1) for n in newest[-50:])
    for k in range(100):  # 100 new keys: two generations' worth; every earlier one is gone
        ends.note([5000 + k])
    assert not any(ends.continues([1000 + k], 1) for k in range(200))
    assert all(ends.continues([5000 + k], 1) for k in range(50, 100))


def test_both_indexes_learn_ends_from_their_records_and_take_numpy_keys():
    keys = [11, 12, 13]
    for index in (ApproxPrefixIndex(100), PreciseIndex(1024)):
        assert not index.continues([*keys, 14], 3)
        index.record(keys, "10.0.0.1:80")
        assert index.continues([*keys, 14], 3)
        assert index.continues(np.array([*keys, 14], dtype=np.uint64), 3)
        assert not index.continues([*keys, 14], 2)
        index.record([21, 22], "10.0.0.1:80", ended=False)  # a prompt's head: not where it ended
        assert index.match([21, 22], ["10.0.0.1:80"]) == {"10.0.0.1:80": 2}
        assert not index.continues([21, 22, 23], 2)
    big = (1 << 64) - 7  # a uint64 key past int64: the same key as an int and a numpy scalar
    precise = PreciseIndex(1024)
    precise.record(np.array([5, big], dtype=np.uint64), "10.0.0.1:80")
    assert precise.continues([5, big, 9], 2)
