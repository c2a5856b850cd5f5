"""Routing decisions: stickiness, prefix affinity, least load, admission bounds."""

import pytest

from undertow.gateway.engine_pool.router import (
    Decision,
    EngineLoad,
    EngineState,
    Router,
    RouterConfig,
    prefix_keys,
)

HEALTHY = EngineState.HEALTHY


def loads(*pairs, state=HEALTHY):
    return [EngineLoad(engine_id, state, num) for engine_id, num in pairs]


def test_new_sessions_spread_by_in_flight_then_pinned_count():
    router = Router(RouterConfig(max_in_flight_per_engine=4))
    engines = loads(("a", 0), ("b", 0))
    first = router.route("s1", [1, 2, 3], engines)
    router.assign("s1", first.engine_id, [1, 2, 3])
    second = router.route("s2", [7, 8, 9], engines)
    assert (first.engine_id, second.engine_id) == ("a", "b")
    assert second.reason == "least_loaded"
    assert router.route("s3", [5], loads(("a", 3), ("b", 1))).engine_id == "b"


def test_session_sticks_to_its_engine_even_when_another_is_idler():
    router = Router(RouterConfig(max_in_flight_per_engine=4))
    router.assign("s1", "b", [1, 2, 3])
    decision = router.route("s1", [1, 2, 3, 4], loads(("a", 0), ("b", 3)))
    assert decision == Decision("b", "pinned")


def test_pinned_engine_that_is_full_moves_the_session():
    router = Router(RouterConfig(max_in_flight_per_engine=2))
    router.assign("s1", "b", [1])
    decision = router.route("s1", [1, 2], loads(("a", 0), ("b", 2)))
    assert decision == Decision("a", "moved")


def test_pinned_engine_that_drains_or_dies_is_not_used():
    router = Router()
    router.assign("s1", "a", [1])
    engines = [EngineLoad("a", EngineState.DRAINING, 0), EngineLoad("b", HEALTHY, 5)]
    assert router.route("s1", [1], engines).engine_id == "b"
    engines = [EngineLoad("a", EngineState.DEAD, 0), EngineLoad("b", HEALTHY, 5)]
    assert router.route("s1", [1], engines).engine_id == "b"


def test_new_session_prefers_engine_caching_its_prefix_within_slack():
    config = RouterConfig(prefix_lengths=(4, 8), affinity_slack=2)
    router = Router(config)
    group_prompt = list(range(100, 110))
    router.assign("s1", "b", group_prompt + [1, 2])
    decision = router.route("s2", group_prompt + [3], loads(("a", 0), ("b", 2)))
    assert decision == Decision("b", "prefix")
    too_busy = router.route("s3", group_prompt + [3], loads(("a", 0), ("b", 3)))
    assert too_busy == Decision("a", "least_loaded")
    other_task = router.route("s4", list(range(200, 210)), loads(("a", 1), ("b", 0)))
    assert other_task.engine_id == "b" and other_task.reason == "least_loaded"


def test_longest_prefix_match_wins():
    router = Router(RouterConfig(prefix_lengths=(2, 6), affinity_slack=10))
    shared = [1, 2, 3, 4, 5, 6, 7]
    router.assign("x", "a", [1, 2, 99, 99, 99, 99])
    router.assign("y", "b", shared)
    assert router.route("z", shared, loads(("a", 0), ("b", 5))).engine_id == "b"


def test_admission_refuses_past_per_engine_and_total_limits():
    router = Router(RouterConfig(max_in_flight_per_engine=2, retry_after_s=3.0))
    refusal = router.route("s", [1], loads(("a", 2), ("b", 2)))
    assert refusal == Decision(None, "busy", 3.0)
    router = Router(RouterConfig(max_in_flight_per_engine=10, max_in_flight_total=3))
    assert router.route("s", [1], loads(("a", 2), ("b", 1))).reason == "busy"
    assert router.route("s", [1], loads(("a", 1), ("b", 1))).engine_id is not None


def test_in_flight_on_draining_engines_counts_toward_total():
    router = Router(RouterConfig(max_in_flight_per_engine=10, max_in_flight_total=2))
    engines = [EngineLoad("a", EngineState.DRAINING, 2), EngineLoad("b", HEALTHY, 0)]
    assert router.route("s", [1], engines).reason == "busy"


def test_no_healthy_engine_is_unavailable():
    router = Router()
    assert router.route("s", [1], []).reason == "unavailable"
    assert router.route("s", [1], loads(("a", 0), state=EngineState.DEAD)).reason == "unavailable"


def test_unpin_engine_and_counts():
    router = Router()
    router.assign("s1", "a", [1])
    router.assign("s2", "a", [2])
    router.assign("s3", "b", [3])
    router.assign("s1", "b", [1])
    assert (router.num_pinned("a"), router.num_pinned("b")) == (1, 2)
    assert sorted(router.unpin_engine("b")) == ["s1", "s3"]
    assert router.pinned("s1") is None and router.pinned("s2") == "a"
    router.unpin("s2")
    assert router.num_pinned("a") == 0


def test_forgotten_engine_loses_its_prefix_record():
    router = Router(RouterConfig(prefix_lengths=(2,)))
    router.assign("s1", "a", [5, 6, 7])
    router.forget_engine("a")
    assert router.route("s2", [5, 6, 8], loads(("b", 1), ("a", 0))).reason == "least_loaded"


def test_prefix_record_is_bounded():
    router = Router(RouterConfig(prefix_lengths=(1,), num_prefixes_per_engine=3))
    for token in range(10):
        router.assign(f"s{token}", "a", [token])
    assert router.route("new", [0], loads(("b", 0), ("a", 0))).reason == "least_loaded"
    assert router.route("new", [9], loads(("b", 0), ("a", 0))).reason == "prefix"


def test_prefix_keys_of_short_prompts_use_their_length():
    assert [n for n, _ in prefix_keys([1, 2, 3], (4, 8))] == [3]
    assert [n for n, _ in prefix_keys(list(range(10)), (4, 8))] == [4, 8]


@pytest.mark.parametrize("bad", [
    {"max_in_flight_per_engine": 0},
    {"max_in_flight_total": 0},
    {"prefix_lengths": (8, 4)},
    {"retry_after_s": 0},
])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        RouterConfig(**bad)


def test_unbounded_routing_for_resumes_ignores_admission_limits():
    router = Router(RouterConfig(max_in_flight_per_engine=1))
    router.assign("s1", "a", [1])
    engines = loads(("a", 1), ("b", 3))
    assert router.route("s1", [1], engines).reason == "busy"
    assert router.route("s1", [1], engines, bounded=False) == Decision("a", "pinned")
