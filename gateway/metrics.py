"""Prometheus metrics of the gateway, in the text exposition format 0.0.4, served at
`GET /metrics`. `GatewayMetrics` declares every metric the gateway exports: the engine
pool records the per-engine ones, the API the call-level ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

LabelValues = tuple[str, ...]

DEFAULT_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                           60.0, 120.0, 300.0)


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(pairs: list[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{_escape_label(value)}"' for name, value in pairs) + "}"


class _Metric:
    """A metric whose name and label names are fixed at creation; every sample passes
    exactly those labels (`_key` refuses others)."""

    kind = ""

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()):
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if len(labels) == len(self.label_names):  # then all names present = the same set
            try:
                return tuple([str(labels[name]) for name in self.label_names])
            except KeyError:
                pass
        raise ValueError(f"metric {self.name} takes labels {list(self.label_names)}, "
                         f"got {sorted(labels)}")

    def _pairs(self, key: LabelValues) -> list[tuple[str, str]]:
        return list(zip(self.label_names, key, strict=True))

    def header(self) -> list[str]:
        help_text = self.help_text.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


MetricT = TypeVar("MetricT", bound=_Metric)


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()):
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total (Prometheus convention)")
        super().__init__(name, help_text, label_names)
        self._values: dict[LabelValues, float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{_format_labels(self._pairs(key))} {_format_value(value)}"
                for key, value in sorted(self._values.items())]


class Gauge(_Metric):
    """A value per label set that may go up and down; `remove` drops a label set
    (e.g. an engine that left the pool)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()):
        super().__init__(name, help_text, label_names)
        self._values: dict[LabelValues, float] = {} if label_names else {(): 0.0}

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def remove(self, **labels: str) -> None:
        """Drops every label set whose values match the given subset of labels."""
        unknown = set(labels) - set(self.label_names)
        if unknown:
            raise ValueError(f"metric {self.name} has no labels {sorted(unknown)}")
        positions = [(self.label_names.index(name), str(value)) for name, value in labels.items()]
        for key in [key for key in self._values
                    if all(key[index] == value for index, value in positions)]:
            del self._values[key]

    def samples(self) -> list[str]:
        return [f"{self.name}{_format_labels(self._pairs(key))} {_format_value(value)}"
                for key, value in sorted(self._values.items())]


class Histogram(_Metric):
    """Observations counted into cumulative buckets (upper bounds `buckets`, plus +Inf)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = DEFAULT_SECONDS_BUCKETS):
        if "le" in label_names:
            raise ValueError(f"histogram {name} cannot use the reserved label 'le'")
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"histogram {name} needs strictly increasing buckets, got {buckets}")
        super().__init__(name, help_text, label_names)
        self.buckets = tuple(float(bound) for bound in buckets)
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                counts[index] += 1
                break
        else:
            counts[-1] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self._counts.get(self._key(labels), []))

    def samples(self) -> list[str]:
        lines = []
        for key, counts in sorted(self._counts.items()):
            pairs = self._pairs(key)
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += count
                le = "+Inf" if math.isinf(bound) else repr(bound)
                labels = _format_labels([*pairs, ("le", le)])
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            lines.append(f"{self.name}_sum{_format_labels(pairs)} "
                         f"{_format_value(self._sums[key])}")
            lines.append(f"{self.name}_count{_format_labels(pairs)} {cumulative}")
        return lines


class Registry:
    """The metrics of one gateway process; `render()` is the body of `GET /metrics`. No
    lock: metrics are touched only from the event loop's thread, so a render reads a
    consistent snapshot."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: MetricT) -> MetricT:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, label_names: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(name, help_text, label_names))

    def gauge(self, name: str, help_text: str, label_names: tuple[str, ...] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, label_names))

    def histogram(self, name: str, help_text: str, label_names: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = DEFAULT_SECONDS_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, label_names, buckets))

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.header())
            lines.extend(metric.samples())
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class GatewayMetrics:
    """Every metric the gateway exports. Call-level metrics are recorded by the API
    (labels: `api` = chat|completions|messages|responses, `status` = the HTTP status its
    client effectively got: a stream that an error event ended counts with the error's
    status, not its head's 200; a call whose client left before its reply's end counts in
    `client_disconnects` instead);
    engine-level ones by the engine pool."""

    registry: Registry
    calls: Counter
    client_disconnects: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    time_to_first_token_s: Histogram
    call_duration_s: Histogram
    open_sessions: Gauge
    closed_sessions: Counter
    token_truth: Counter
    branches: Counter
    resumes: Counter
    resume_prompt_tokens: Counter
    engine_generations: Counter
    engine_in_flight: Gauge
    engine_state: Gauge
    admission_refusals: Counter
    admission_waiting: Gauge
    admission_wait_s: Histogram
    unparsed_tool_calls: Counter
    store_trees_in_memory: Gauge
    store_tree_loads: Counter
    store_damaged_groups: Gauge
    store_held_bytes: Gauge
    store_dropped_lines: Counter

    @classmethod
    def create(cls, registry: Registry | None = None) -> GatewayMetrics:
        r = registry if registry is not None else Registry()
        return cls(
            registry=r,
            calls=r.counter("undertow_calls_total", "Scaffold calls answered, by the status "
                            "their client got (a stream's error event: the error's status).",
                            ("api", "status")),
            client_disconnects=r.counter(
                "undertow_client_disconnects_total", "Scaffold calls whose client closed the "
                "connection before the reply's end (not in undertow_calls_total; a stream's "
                "engine request is aborted).", ("api",)),
            prompt_tokens=r.counter("undertow_prompt_tokens_total", "Prompt tokens sent.",
                                    ("api",)),
            completion_tokens=r.counter("undertow_completion_tokens_total",
                                        "Completion tokens sampled.", ("api",)),
            time_to_first_token_s=r.histogram("undertow_time_to_first_token_seconds",
                                              "Time from request to first token.", ("api",)),
            call_duration_s=r.histogram("undertow_call_duration_seconds",
                                        "Time from request to last byte of the reply.", ("api",)),
            open_sessions=r.gauge("undertow_open_sessions", "Sessions open at the gateway."),
            closed_sessions=r.counter(
                "undertow_sessions_closed_total", "Sessions closed, by the cause in their close "
                "meta; infra_failure=true: Undertow failed them (never trained, re-run).",
                ("cause", "infra_failure")),
            token_truth=r.counter("undertow_token_truth_total",
                                  "Prompts built by token truth (hit) or rendered in full.",
                                  ("outcome",)),
            branches=r.counter("undertow_branches_total", "Tree branches started, by reason.",
                               ("reason",)),
            resumes=r.counter("undertow_resumes_total",
                              "Generations resumed from partial output, by cause "
                              "(engine_died, pause, migrate).", ("cause",)),
            resume_prompt_tokens=r.counter(
                "undertow_resume_prompt_tokens_total", "Prompt tokens of resumed generations "
                "(prompt + partial output), by cause and by where the engine got their KV: "
                "storage (shared KV storage, SGLang's HiCache), cache (its own prefix cache, "
                "a KV migration's staging included) or prefill (computed anew).",
                ("cause", "source")),
            engine_generations=r.counter("undertow_engine_generations_total",
                                         "Generation requests sent to each engine.", ("engine",)),
            engine_in_flight=r.gauge("undertow_engine_in_flight",
                                     "Generations in flight on each engine.", ("engine",)),
            engine_state=r.gauge("undertow_engine_state",
                                 "1 for the engine's current state (healthy, draining, dead).",
                                 ("engine", "state")),
            admission_refusals=r.counter("undertow_admission_refusals_total",
                                         "Generations refused with 429 (pool at its limit "
                                         "past router.admission_wait_s)."),
            admission_waiting=r.gauge("undertow_admission_waiting",
                                      "Calls waiting for admission (every engine at its bound, "
                                      "or the pool paused)."),
            admission_wait_s=r.histogram(
                "undertow_admission_wait_seconds", "Time calls waited for admission, by how "
                "the wait ended (admitted, refused, left, failed); calls admitted at once are "
                "not counted.", ("outcome",)),
            unparsed_tool_calls=r.counter("undertow_unparsed_tool_calls_total",
                                          "Tool calls the parser could not read (returned to the "
                                          "scaffold as text).", ("parser",)),
            store_trees_in_memory=r.gauge(
                "undertow_store_trees_in_memory", "Group trees the tree store holds in memory "
                "(every active group's, and the most recently used idle ones)."),
            store_tree_loads=r.counter("undertow_store_tree_loads_total",
                                       "Group trees loaded back from their log file after "
                                       "being let go (start-up replay not counted)."),
            store_damaged_groups=r.gauge(
                "undertow_store_damaged_groups", "1 for each group set aside at start-up: its "
                "log is damaged (`undertow trees repair`); the other groups serve.", ("group",)),
            store_held_bytes=r.gauge("undertow_store_held_bytes", "Bytes of streamed calls' "
                                     "log lines held in memory until the disk takes them."),
            store_dropped_lines=r.counter(
                "undertow_store_dropped_lines_total", "Held log lines dropped past the hold's "
                "bounds (their sessions are infra failures)."),
        )
