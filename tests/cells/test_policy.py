"""The pool's roles, transition table and policies, on hand-made snapshots."""

import pytest

from undertow.cells import (
    BatchProgress,
    Cell,
    DispatchBatch,
    IllegalTransition,
    MoveToRollout,
    MoveToTraining,
    PolicyConfigError,
    PoolState,
    Role,
    StartTraining,
    begin_switch,
    finish_switch,
    make_policy,
)
from undertow.cells.cell import change_role


def rollout_cells(*num_sessions, slots=8):
    return tuple(Cell(i, Role.ROLLOUT, slots, n) for i, n in enumerate(num_sessions))


def batch(finished, sessions=32, dispatched=None, started=False, step=0):
    return BatchProgress(step, sessions, sessions if dispatched is None else dispatched,
                         finished, started)


# ---- cells and transitions

def test_a_cell_goes_round_through_switching():
    cell = Cell(0, Role.ROLLOUT, 8, 3)
    going = begin_switch(cell)
    assert (going.role, going.heading, going.num_sessions) == (Role.SWITCHING, Role.TRAINING, 0)
    training = finish_switch(going)
    assert (training.role, training.heading) == (Role.TRAINING, None)
    back = finish_switch(begin_switch(training))
    assert back.role is Role.ROLLOUT


@pytest.mark.parametrize(("role", "to", "heading"), [
    (Role.ROLLOUT, Role.TRAINING, None),
    (Role.TRAINING, Role.ROLLOUT, None),
    (Role.ROLLOUT, Role.ROLLOUT, None),
    (Role.ROLLOUT, Role.SWITCHING, Role.ROLLOUT),
    (Role.TRAINING, Role.SWITCHING, Role.TRAINING),
])
def test_illegal_transitions_raise(role, to, heading):
    with pytest.raises(IllegalTransition):
        change_role(Cell(0, role, 8), to, heading)


def test_a_switching_cell_arrives_only_where_it_heads():
    going = begin_switch(Cell(0, Role.ROLLOUT, 8))
    with pytest.raises(IllegalTransition, match="switching to training"):
        change_role(going, Role.ROLLOUT)
    with pytest.raises(IllegalTransition, match="already switching"):
        begin_switch(going)
    with pytest.raises(IllegalTransition, match="not switching"):
        finish_switch(Cell(1, Role.TRAINING, 8))


def test_cell_invariants():
    with pytest.raises(ValueError, match="heading"):
        Cell(0, Role.SWITCHING, 8)
    with pytest.raises(ValueError, match="heading"):
        Cell(0, Role.ROLLOUT, 8, heading=Role.TRAINING)
    with pytest.raises(ValueError, match="slots"):
        Cell(0, Role.ROLLOUT, 0)
    with pytest.raises(ValueError, match="finished"):
        BatchProgress(0, 4, 2, 3)


# ---- elastic: the waterlevel rule

def test_elastic_waits_while_outstanding_exceed_remaining_capacity():
    # C_R = 32, C_e = 8: moving needs w <= 24.
    state = PoolState(rollout_cells(8, 8, 8, 8), (batch(finished=7),), num_steps=2)
    assert make_policy("elastic").decide(state) == []


def test_elastic_moves_the_least_loaded_cell_when_sessions_fit_without_it():
    state = PoolState(rollout_cells(8, 7, 3, 6), (batch(finished=8),), num_steps=2)
    assert make_policy("elastic").decide(state) == [MoveToTraining(2), StartTraining(0)]


def test_elastic_moves_one_cell_at_a_time():
    cells = (*rollout_cells(4, 2, 1), Cell(3, Role.SWITCHING, 8, heading=Role.TRAINING))
    state = PoolState(cells, (batch(finished=25, started=True),), num_steps=2)
    assert make_policy("elastic").decide(state) == []
    arrived = (*rollout_cells(4, 2, 1), Cell(3, Role.TRAINING, 8))
    state = PoolState(arrived, (batch(finished=25, started=True),), num_steps=2)
    assert make_policy("elastic").decide(state) == [MoveToTraining(2)]


def test_elastic_never_moves_the_last_rollout_cell_while_sessions_remain():
    cells = (*rollout_cells(1), Cell(1, Role.TRAINING, 8), Cell(2, Role.TRAINING, 8))
    policy = make_policy("elastic")
    assert policy.decide(PoolState(cells, (batch(finished=31, started=True),), num_steps=2)) == []
    done = PoolState(rollout_cells(0) + cells[1:], (batch(finished=32, started=True),),
                     num_steps=2)
    assert policy.decide(done) == [MoveToTraining(0)]


def test_elastic_waits_until_the_whole_batch_is_dispatched():
    state = PoolState(rollout_cells(1, 1, 0, 0), (batch(finished=0, dispatched=2),), num_steps=2)
    assert make_policy("elastic").decide(state) == []


def test_elastic_returns_every_cell_after_the_step_and_dispatches_the_next():
    cells = (*rollout_cells(0), Cell(1, Role.TRAINING, 8), Cell(2, Role.TRAINING, 8))
    policy = make_policy("elastic")
    state = PoolState(cells, (), weight_version=1, num_steps=3)
    assert policy.decide(state) == [MoveToRollout(1), MoveToRollout(2), DispatchBatch(1)]
    last = PoolState(cells, (), weight_version=3, num_steps=3)
    assert policy.decide(last) == [MoveToRollout(1), MoveToRollout(2)]


def test_elastic_weighs_each_cells_own_capacity():
    cells = (Cell(0, Role.ROLLOUT, 16, 10), Cell(1, Role.ROLLOUT, 4, 2))
    # C_R = 20; the least-loaded cell (1) has C_e = 4: w = 16 fits, w = 17 does not.
    assert make_policy("elastic").decide(
        PoolState(cells, (batch(finished=16),), num_steps=1)) == [MoveToTraining(1),
                                                                   StartTraining(0)]
    assert make_policy("elastic").decide(PoolState(cells, (batch(finished=15),))) == []


def test_elastic_refuses_a_negative_staleness():
    with pytest.raises(PolicyConfigError, match="max_staleness=-1"):
        make_policy({"name": "elastic", "max_staleness": -1})


# ---- elastic, asynchronous (max_staleness 1)

def async_elastic():
    return make_policy({"name": "elastic", "max_staleness": 1})


def test_async_elastic_dispatches_up_to_its_staleness_one_step_per_round():
    policy = async_elastic()
    assert policy.decide(PoolState(rollout_cells(0, 0, 0, 0), num_steps=4)) == [DispatchBatch(0)]
    state = PoolState(rollout_cells(8, 8, 8, 8), (batch(finished=0),), num_steps=4)
    assert policy.decide(state) == [DispatchBatch(1)]
    both = PoolState(rollout_cells(8, 8, 8, 8), (batch(finished=0), batch(0, step=1)), 0, 4)
    assert policy.decide(both) == []


def test_async_elastic_counts_the_next_steps_queued_sessions_in_the_waterlevel():
    # Step 0 is down to 4 outstanding, but step 1's 32 wait for slots: w = 36 > 32 - 8.
    running = (batch(finished=28), batch(finished=0, step=1))
    state = PoolState(rollout_cells(8, 8, 8, 8), running, num_steps=4)
    assert async_elastic().decide(state) == []
    # Once step 1 is half done, w = 4 + 16 = 20 <= 24: the emptiest cell moves for step 0.
    running = (batch(finished=28), batch(finished=16, step=1))
    state = PoolState(rollout_cells(8, 7, 3, 2), running, num_steps=4)
    assert async_elastic().decide(state) == [MoveToTraining(3), StartTraining(0)]


def test_async_elastic_keeps_the_cells_the_next_step_does_not_need():
    cells = (*rollout_cells(8, 8), *(Cell(i, Role.TRAINING, 8) for i in (2, 3, 4)))
    # Step 0 published; step 1, the last, has 20 outstanding on 16 rollout slots.
    state = PoolState(cells, (batch(finished=12, step=1),), weight_version=1, num_steps=2)
    assert async_elastic().decide(state) == [MoveToRollout(2), StartTraining(1)]
    # With 12 outstanding nobody waits for a slot: every training cell trains step 1 at once.
    state = PoolState(cells, (batch(finished=20, step=1),), weight_version=1, num_steps=2)
    assert async_elastic().decide(state) == [StartTraining(1)]


def test_async_elastic_returns_every_cell_when_a_new_step_fills_the_slots():
    cells = (*rollout_cells(4, 4), *(Cell(i, Role.TRAINING, 8) for i in (2, 3)))
    # Step 0 published: step 2 (32 sessions) is dispatched first, then the cells go back.
    state = PoolState(cells, (batch(finished=24, step=1),), weight_version=1, num_steps=4)
    assert async_elastic().decide(state) == [DispatchBatch(2)]
    both = (batch(finished=24, step=1), batch(finished=0, step=2))
    state = PoolState(cells, both, weight_version=1, num_steps=4)
    assert async_elastic().decide(state) == [MoveToRollout(2), MoveToRollout(3)]


def test_async_elastic_returns_every_cell_when_nothing_is_left_to_train():
    cells = (*rollout_cells(0), Cell(1, Role.TRAINING, 8))
    assert async_elastic().decide(PoolState(cells, (), weight_version=3, num_steps=3)) \
        == [MoveToRollout(1)]


# ---- colocate and split

def test_colocate_trains_only_after_the_slowest_session():
    policy = make_policy("colocate")
    cells = rollout_cells(1, 0, 0)
    assert policy.decide(PoolState(cells, (batch(finished=31),), num_steps=2)) == []
    assert policy.decide(PoolState(rollout_cells(0, 0, 0), (batch(finished=32),), num_steps=2)) \
        == [MoveToTraining(0), MoveToTraining(1), MoveToTraining(2), StartTraining(0)]


def test_split_sets_up_its_ratio_then_keeps_it():
    policy = make_policy({"name": "split", "num_training_cells": 2})
    start = policy.decide(PoolState(rollout_cells(0, 0, 0, 0), num_steps=4))
    assert start == [MoveToTraining(3), MoveToTraining(2), DispatchBatch(0), StartTraining(0)]
    cells = (*rollout_cells(4, 4), Cell(2, Role.TRAINING, 8), Cell(3, Role.TRAINING, 8))
    running = (batch(finished=3, started=True), batch(finished=0, step=1))
    assert policy.decide(PoolState(cells, running, num_steps=4)) == []


def test_split_dispatches_the_next_step_while_the_tail_runs():
    policy = make_policy({"name": "split", "num_training_cells": 1, "max_staleness": 1})
    cells = (*rollout_cells(8, 8), Cell(2, Role.TRAINING, 8))
    # Step 0 has 16 sessions still running on weights 0; step 1 may already queue behind them.
    assert policy.decide(PoolState(cells, (batch(finished=16, started=True),), 0, 4)) \
        == [DispatchBatch(1)]


def test_split_respects_its_staleness_bound():
    policy = make_policy({"name": "split", "num_training_cells": 1, "max_staleness": 1})
    cells = (*rollout_cells(0, 0), Cell(2, Role.TRAINING, 8))
    step0_training = batch(finished=32, started=True, step=0)
    # Step 0 generated: step 1 may run on weights 0 (staleness 1) ...
    assert policy.decide(PoolState(cells, (step0_training,), 0, 4)) == [DispatchBatch(1)]
    # ... but step 2 may not start before step 0 is published (it would be 2 behind).
    step1_done = batch(finished=32, step=1)
    assert policy.decide(PoolState(cells, (step0_training, step1_done), 0, 4)) == []
    assert policy.decide(PoolState(cells, (step1_done,), 1, 4)) == [DispatchBatch(2),
                                                                    StartTraining(1)]


def test_split_with_no_staleness_is_synchronous():
    policy = make_policy({"name": "split", "num_training_cells": 1, "max_staleness": 0})
    cells = (*rollout_cells(0, 0), Cell(2, Role.TRAINING, 8))
    assert policy.decide(PoolState(cells, (batch(32, started=True),), 0, 4)) == []


def test_split_needs_a_rollout_cell():
    policy = make_policy({"name": "split", "num_training_cells": 4})
    with pytest.raises(PolicyConfigError, match="at most 3"):
        policy.decide(PoolState(rollout_cells(0, 0, 0, 0)))


# ---- choosing by name

def test_policies_are_chosen_by_name_or_plain_dict():
    assert make_policy("colocate").name == "colocate"
    split = make_policy({"name": "split", "num_training_cells": 3, "max_staleness": 2})
    assert (split.name, split.num_training_cells, split.max_staleness) == ("split", 3, 2)
    with pytest.raises(PolicyConfigError, match="choose one of"):
        make_policy("waterfall")
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy({"name": "elastic", "ratio": 2})
    with pytest.raises(PolicyConfigError, match="give 0 or more"):
        make_policy({"name": "split", "num_training_cells": -1})


def test_split_with_no_training_cell_never_moves_and_starts_each_step_at_once():
    """The run without a pool section (`undertow/cells/one_cell.py`): one rollout cell,
    steps dispatched within the staleness bound and opened as soon as dispatched."""
    policy = make_policy({"name": "split", "num_training_cells": 0, "max_staleness": 1})
    (cell,) = rollout_cells(2)
    assert policy.decide(PoolState((cell,), (), num_steps=3)) == [DispatchBatch(0),
                                                                  StartTraining(0)]
    running = PoolState((cell,), (batch(finished=0, started=True),), num_steps=3)
    assert policy.decide(running) == [DispatchBatch(1)]
    behind = PoolState((cell,), (batch(0, started=True), batch(0, step=1)), num_steps=3)
    assert policy.decide(behind) == []   # step 2 would train on weights 2 behind


def test_decide_is_pure():
    state = PoolState(rollout_cells(8, 7, 3, 6), (batch(finished=8),), num_steps=2)
    policy = make_policy("elastic")
    first = policy.decide(state)
    assert policy.decide(state) == first
    assert state == PoolState(rollout_cells(8, 7, 3, 6), (batch(finished=8),), num_steps=2)
