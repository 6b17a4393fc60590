"""What every soak phase shares: timeouts, the record of how a response ended (`Outcome`), a phase's
result (`PhaseResult`), the checks that turn outcomes and the server's state (KV blocks, running
requests, /metrics) into problems, and the process's RSS."""
from __future__ import annotations

import gc
import string
from collections import Counter
from dataclasses import asdict, dataclass, field

from tests.server.harness import ServerThread

EVENT_TIMEOUT_S = 60.0  # the longest wait for one server event / SSE line under load
SETTLE_S = 15.0  # after the last response ended: KV blocks and running requests back to 0 by then
PROMPT_CHARS = string.ascii_letters + string.digits + " "
FAULT_SEED = 4242  # the request whose engine steps raise in the fault phase


@dataclass(slots=True)
class Outcome:
    """How one response ended, as the client saw it.

    `plan`: full (read to the end), cancel (WS `response.cancel` mid-stream), disconnect (the client
    went away mid-stream), slow (the socket stopped reading for a while), poison (the fault phase's
    chosen request). `status`: the WS `response.done` status, "done" (SSE [DONE] or a 200 JSON body),
    "disconnected" (we left), or what went wrong ("http 500", "error chunk", "lost", "timeout")."""

    kind: str  # ws | sse | http
    plan: str
    spec: dict
    status: str = ""
    streamed: dict[int, int] = field(default_factory=dict)  # output index -> token ids streamed
    usage_output_tokens: int | None = None
    error: str = ""

    @property
    def n(self) -> int:
        return self.spec.get("n", 1)

    @property
    def max_tokens(self) -> int:
        return self.spec.get("max_output_tokens") or self.spec.get("max_tokens")


@dataclass
class PhaseResult:
    name: str
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# -- checks ----------------------------------------------------------------------------------------

ENDED_OK = {"ws": {"full": {"incomplete"}, "slow": {"incomplete"}, "cancel": {"cancelled", "incomplete"},
                   "disconnect": {"disconnected", "incomplete", "cancelled"}},
            "sse": {"full": {"done"}, "disconnect": {"disconnected", "done"}},
            "http": {"full": {"done"}}}


def check_outcome(o: Outcome) -> str | None:
    """What is wrong with one ended response (None: nothing). Complete answers must carry exactly
    max tokens per sample (ignore_eos), streamed and in usage."""
    ok = ENDED_OK[o.kind].get(o.plan, set())
    if o.status not in ok:
        return f"{o.kind} {o.plan} ended {o.status!r} (want {sorted(ok)}): {o.error[:200]} spec={o.spec}"
    total = sum(o.streamed.values())
    complete = o.status in ("incomplete", "done") and o.plan != "disconnect"
    if complete:
        want = {i: o.max_tokens for i in range(o.n)}
        if o.kind != "http" and o.streamed != want:
            return f"{o.kind} {o.plan}: streamed tokens per sample {o.streamed}, want {want} spec={o.spec}"
        if o.usage_output_tokens != o.max_tokens * o.n:
            return f"{o.kind} {o.plan}: usage output tokens {o.usage_output_tokens}, want " \
                   f"{o.max_tokens * o.n} spec={o.spec}"
    elif o.status == "cancelled" and o.usage_output_tokens is not None \
            and not total <= o.usage_output_tokens <= o.max_tokens * o.n:
        return f"ws cancel: usage output tokens {o.usage_output_tokens}, streamed {total} spec={o.spec}"
    return None


def check_outcomes(outcomes: list[Outcome], limit: int = 20) -> list[str]:
    problems = [p for p in map(check_outcome, outcomes) if p]
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


def count_outcomes(outcomes: list[Outcome]) -> dict:
    return dict(Counter(f"{o.kind}:{o.plan}:{o.status}" for o in outcomes))


def scrape_metrics(server: ServerThread) -> dict[str, float]:
    """`specserve:*` samples of /metrics, labels dropped (one model per server)."""
    out = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("specserve:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def check_server(server: ServerThread, settle_s: float = SETTLE_S) -> tuple[list[str], dict]:
    """After every response ended: no KV block held, nothing running or waiting (engine stats and the
    /metrics gauges agree), within `settle_s`."""
    stats = server.wait_blocks(0, settle_s)
    problems = [f"engine {key} = {stats[key]} after all responses ended (settled {settle_s}s)"
                for key in ("num_used_blocks", "num_requests_running", "num_requests_waiting") if stats[key]]
    metrics = scrape_metrics(server)
    for name in ("specserve:num_requests_running", "specserve:num_requests_waiting",
                 "specserve:kv_cache_usage_perc"):
        if metrics.get(name, 0.0) != 0.0:
            problems.append(f"/metrics {name} = {metrics[name]} after all responses ended")
    return problems, stats


def rss_bytes() -> int:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_after_gc() -> int:
    gc.collect()
    return rss_bytes()
