"""Prometheus metrics, named `specserve:*` after vLLM's `vllm:*` metrics.

Each app owns a `CollectorRegistry` (several apps may live in one process, e.g. in tests).
Engine-wide gauges and counters (running/waiting requests, KV usage, prefix-cache queries/hits,
speculative decoding drafts/accepted tokens) are read from `AsyncEngine.stats()` at scrape time;
per-request histograms and counters are observed by the server as requests stream and finish.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector(Collector):
    """Reads the engine's latest stats snapshot when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict | None], model_name: str, spec_fallback: list[int]) -> None:
        self._stats = stats
        self._model = model_name
        self._spec_fallback = spec_fallback  # per-request sums, for engines without spec counters

    def collect(self) -> Iterator:
        s = self._stats() or {}
        labels = ["model_name"]
        for name, key, doc in (
                ("num_requests_running", "num_requests_running", "Requests in the running batch."),
                ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
                ("kv_cache_usage_perc", "kv_cache_usage_perc", "KV cache usage, 0..1 (1 = full)."),
                ("num_kv_blocks", "num_blocks", "KV cache blocks in the pool.")):
            g = GaugeMetricFamily(f"specserve:{name}", doc, labels=labels)
            g.add_metric([self._model], float(s.get(key, 0) or 0))
            yield g
        for name, key, doc in (
                ("prefix_cache_queries", "prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                ("num_preemptions", "num_preemptions", "Requests preempted (recomputed later)."),
                ("kv_cache_evictions", "num_evictions", "Cached KV blocks evicted for reuse."),
                ("kv_cache_cow_copies", "num_cow_copies", "Copy-on-write block copies.")):
            c = CounterMetricFamily(f"specserve:{name}", doc, labels=labels)
            c.add_metric([self._model], float(s.get(key, 0) or 0))
            yield c
        for i, (name, doc) in enumerate((
                ("spec_decode_num_drafts", "Draft proposals verified."),
                ("spec_decode_num_draft_tokens", "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))):
            c = CounterMetricFamily(f"specserve:{name}", doc, labels=labels)
            c.add_metric([self._model], float(s.get(name, self._spec_fallback[i]) or 0))
            yield c
        for name, doc in (("accepted", "Verifications that accepted the draft at this position."),
                          ("judged", "Verifications that judged a draft at this position (accepted every one "
                                     "before it).")):
            c = CounterMetricFamily(f"specserve:spec_decode_num_{name}_tokens_per_pos", doc,
                                    labels=labels + ["position"])
            for pos, value in enumerate(s.get(f"spec_decode_num_{name}_tokens_per_pos") or []):
                c.add_metric([self._model, str(pos)], float(value))
            yield c


class ServerMetrics:
    """The server's collectors, registered in a registry of their own."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, lab = self.registry, ["model_name"]
        self.spec_totals = [0, 0, 0]  # drafts, draft tokens, accepted: summed from finished requests
        self.registry.register(_EngineCollector(stats, model_name, self.spec_totals))

        def counter(name: str, doc: str, labels: list[str] = lab) -> Counter:
            return Counter(f"specserve:{name}", doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"specserve:{name}", doc, lab, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       lab + ["finished_reason"])
        self.request_failure = counter("request_failure", "Requests that failed in the engine.")
        self.request_cancelled = counter("request_cancelled", "Requests cancelled or disconnected.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed steps of a request.",
                             _ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited, from arrival to its first scheduled step.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request.", _TOKEN_BUCKETS)
        # create the labelled children now so every series is exported (at 0) before the first request
        for c in (self.prompt_tokens, self.generation_tokens, self.request_failure, self.request_cancelled):
            c.labels(model_name)
        for reason in ("stop", "length"):
            self.request_success.labels(model_name, reason)
        for h in (self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.request_prompt_tokens,
                  self.request_generation_tokens):
            h.labels(model_name)

    def add_spec(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        for i, v in enumerate((drafts, draft_tokens, accepted)):
            self.spec_totals[i] += v

    def render(self) -> bytes:
        return generate_latest(self.registry)
