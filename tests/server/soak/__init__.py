"""Soak, fault and fuzz load against a real server (shared by tests/server/test_soak.py, test_fuzz.py
and bench/soak.py; docs/soak.md says what each phase does).

Every load generator records how each response ended, as the client saw it (`Outcome`); the checks
turn those records and the server's state (KV blocks, running requests, /metrics, RSS) into a list
of problems, each naming its reproducer. An empty list is a pass. The server runs in this process
(tests/server/harness.py's ServerThread) so the checks can read the engine and inject faults.

common: timeouts, `Outcome`, `PhaseResult`, the outcome and server checks, RSS. clients: the WS, SSE
and HTTP clients and the request specs. streams: phase 1. faults: phases 2 (KV exhaustion) and 3 (an
injected engine fault). fuzz_inputs: raw JSON, the hypothesis strategies, `POISON`. fuzz: phase 4's
oracle (`Fuzzer`) and driver (`run_fuzz`).
"""
from tests.server.soak.common import Outcome, PhaseResult, check_server, rss_after_gc, rss_bytes
from tests.server.soak.faults import FAULT_SERVER, KV_SERVER, FaultInjector, phase_fault, phase_kv_exhaustion
from tests.server.soak.fuzz import FUZZ_SERVER, Fuzzer, run_fuzz
from tests.server.soak.fuzz_inputs import POISON
from tests.server.soak.streams import STREAMS_SERVER, StreamLoad, phase_streams

__all__ = [
    "FAULT_SERVER", "FUZZ_SERVER", "KV_SERVER", "POISON", "STREAMS_SERVER", "FaultInjector", "Fuzzer", "Outcome",
    "PhaseResult", "StreamLoad", "check_server", "phase_fault", "phase_kv_exhaustion", "phase_streams",
    "rss_after_gc", "rss_bytes", "run_fuzz",
]
