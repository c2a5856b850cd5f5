"""The Prometheus registry: exposition format, label checks, histogram buckets."""

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from undertow.gateway.metrics import GatewayMetrics, Registry


def parse(text):
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_value(families, family_name, sample_name, **labels):
    for sample in families[family_name].samples:
        if sample.name == sample_name and sample.labels == labels:
            return sample.value
    raise KeyError((sample_name, labels))


def test_counters_gauges_histograms_render_and_parse():
    registry = Registry()
    calls = registry.counter("x_calls_total", "Calls.", ("api",))
    load = registry.gauge("x_load", "Load.", ("engine",))
    latency = registry.histogram("x_latency_seconds", "Latency.", ("api",), buckets=(0.1, 1.0))
    calls.inc(api="chat")
    calls.inc(2, api="chat")
    calls.inc(api='we"ird\\')
    load.set(3, engine="e1")
    load.dec(engine="e1")
    for value in (0.05, 0.5, 0.7, 5.0):
        latency.observe(value, api="chat")
    families = parse(registry.render())
    assert sample_value(families, "x_calls", "x_calls_total", api="chat") == 3
    assert sample_value(families, "x_calls", "x_calls_total", api='we"ird\\') == 1
    assert sample_value(families, "x_load", "x_load", engine="e1") == 2
    buckets = {s.labels["le"]: s.value for s in families["x_latency_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 1, "1.0": 3, "+Inf": 4}
    assert sample_value(families, "x_latency_seconds", "x_latency_seconds_count", api="chat") == 4
    total = sample_value(families, "x_latency_seconds", "x_latency_seconds_sum", api="chat")
    assert math.isclose(total, 6.25)


def test_unlabelled_metrics_render_zero_before_use():
    registry = Registry()
    registry.counter("x_refusals_total", "Refusals.")
    registry.gauge("x_open", "Open.")
    families = parse(registry.render())
    assert sample_value(families, "x_refusals", "x_refusals_total") == 0
    assert sample_value(families, "x_open", "x_open") == 0


def test_wrong_labels_and_decreasing_counters_are_errors():
    registry = Registry()
    calls = registry.counter("x_calls_total", "Calls.", ("api",))
    with pytest.raises(ValueError, match="takes labels"):
        calls.inc(engine="e1")
    with pytest.raises(ValueError, match="cannot decrease"):
        calls.inc(-1, api="chat")
    with pytest.raises(ValueError, match="already registered"):
        registry.counter("x_calls_total", "Again.")
    with pytest.raises(ValueError, match="_total"):
        registry.counter("x_calls", "No suffix.")


def test_gauge_remove_drops_matching_label_sets():
    registry = Registry()
    state = registry.gauge("x_state", "State.", ("engine", "state"))
    state.set(1, engine="e1", state="healthy")
    state.set(0, engine="e1", state="dead")
    state.set(1, engine="e2", state="healthy")
    state.remove(engine="e1")
    text = registry.render()
    assert 'engine="e1"' not in text and 'engine="e2"' in text


def test_gateway_metrics_declares_parseable_families():
    metrics = GatewayMetrics.create()
    metrics.calls.inc(api="chat", status="200")
    metrics.resumes.inc(cause="engine_died")
    metrics.time_to_first_token_s.observe(0.2, api="chat")
    families = parse(metrics.registry.render())
    assert {"undertow_calls", "undertow_resumes", "undertow_engine_in_flight",
            "undertow_time_to_first_token_seconds", "undertow_open_sessions"} <= set(families)
    assert sample_value(families, "undertow_resumes", "undertow_resumes_total",
                        cause="engine_died") == 1
