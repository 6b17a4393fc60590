"""Fair share of sequence slots between owners (the scheduler alone, no model): admission goes to the
owner with the fewest running requests, and a newcomer gets a slot within one step even when one owner
holds them all. Offline requests (one owner) keep plain arrival order."""
from __future__ import annotations

from collections import Counter

from specserve.cache.kv_cache_manager import KVCacheManager
from specserve.config import SchedulerConfig
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.sampling_params import SamplingParams


def scheduler(max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=64),
                     KVCacheManager(64, 4))


def request(req_id: str, owner: str | None) -> Request:
    return Request(req_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), owner=owner)


def step(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.advance(out)
    for r in out.scheduled:  # pretend each sampled one token
        if r.sample:
            r.request.num_pending -= 1
            r.request.append_output_token(7)
    return [r.request.request_id for r in out.scheduled]


def test_newcomer_gets_a_slot_at_once_when_one_owner_holds_all():
    s = scheduler(4)
    for i in range(6):
        s.add_request(request(f"a{i}", "A"))
    assert step(s) == ["a0", "a1", "a2", "a3"]
    s.add_request(request("b0", "B"))
    ids = step(s)
    assert "b0" in ids and "a3" not in ids  # a3, A's newest, made room
    assert s.requests["a3"].num_preemptions == 1 and s.num_running == 4
    s.finish_request("a4", RequestStatus.FINISHED_ABORTED)  # leaves the waiting queue
    assert s._waiting_owners == Counter(r.owner for r in s.waiting) == Counter({"A": 2})


def test_admission_is_cheap_behind_a_long_single_owner_queue():
    """One owner (offline) stops the search at the queue's head: admission does not scan the queue."""
    s = scheduler(4)
    for i in range(5000):
        s.add_request(request(f"x{i}", None))
    scanned = []
    original = type(s.waiting).__iter__

    class CountingDeque(type(s.waiting)):
        def __iter__(self):
            for n, r in enumerate(original(self)):
                scanned.append(n)
                yield r
    s.waiting = CountingDeque(s.waiting)
    assert step(s) == ["x0", "x1", "x2", "x3"]
    assert len(scanned) <= 4 * 2


def test_admission_goes_to_the_owner_with_the_fewest_running():
    s = scheduler(4)
    for i in range(4):
        s.add_request(request(f"a{i}", "A"))
    s.add_request(request("b0", "B"))
    s.add_request(request("c0", "C"))
    assert sorted(step(s)) == ["a0", "a1", "b0", "c0"]  # B and C are not queued behind A's backlog


def test_one_owner_keeps_arrival_order_and_is_never_preempted_for_itself():
    s = scheduler(3)
    for i in range(5):
        s.add_request(request(f"x{i}", None))
    assert step(s) == ["x0", "x1", "x2"]
    assert step(s) == ["x0", "x1", "x2"]
    assert s.num_preemptions == 0


def test_isolation_schedules_only_the_first_set():
    s = scheduler(4)
    for i in range(4):
        s.add_request(request(f"r{i}", None))
    s.isolate = [{"r2"}, {"r0", "r1"}]
    assert step(s) == ["r2"]
    s.isolate.pop(0)
    assert sorted(step(s)) == ["r0", "r1"]


def greedy(request: Request) -> bool:
    return request.sampling_params.greedy


def test_a_step_is_scheduled_ahead_only_in_a_drafting_batch():
    """Async drafting schedules a drafting batch's next step before its tokens are known
    (`schedule_ahead`): a queue behind a full batch of its own owner does not stop it; a newcomer
    owner (a slot by preemption), a predecessor that may end every request, or a position that may
    lie past max_model_len does. Placed as if every draft were accepted, with every draft near
    max_tokens, cut short of max_model_len."""
    s = scheduler(2)
    s.config.max_model_len = 256
    for i in range(3):
        s.add_request(Request(f"a{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=40), owner="A"))
    step(s)
    prev = s.schedule()  # a verification of 2 drafts each (as if drafted)
    for r in prev.scheduled:
        r.spec_token_ids = [9, 9]
        r.num_tokens += 2
    ahead = s.schedule_ahead(prev, [3, 3], greedy)
    assert [r.request.request_id for r in ahead.scheduled] == ["a0", "a1"]
    assert all(r.start == p.start + p.num_tokens and r.num_tokens == 4 and len(r.spec_token_ids) == 3
               for r, p in zip(ahead.scheduled, prev.scheduled))
    s.add_request(request("b0", "B"))  # a newcomer: schedule() would preempt for it
    assert s.schedule_ahead(prev, [3, 3], greedy) is None
    s.finish_request("b0", RequestStatus.FINISHED_ABORTED)
    assert s.schedule_ahead(prev, [3, 3], greedy) is not None
    # near max_tokens every draft is verified (tokens past the end are dropped, as past a stop token);
    # not where prev may end every request (its 1 + 2 tokens reach both ends)
    a0, a1 = s.requests["a0"], s.requests["a1"]
    a0.sampling_params.max_tokens = a0.num_output_tokens + 3
    assert [len(r.spec_token_ids) for r in s.schedule_ahead(prev, [3, 3], greedy).scheduled] == [3, 3]
    a1.sampling_params.max_tokens = a1.num_output_tokens + 3
    assert s.schedule_ahead(prev, [3, 3], greedy) is None
    a1.sampling_params.max_tokens = a1.num_output_tokens + 4
    # drafts whose positions would pass max_model_len are cut; a next position past it stops the step
    start = prev.scheduled[0].start + prev.scheduled[0].num_tokens
    s.config.max_model_len = start + 2
    ahead = s.schedule_ahead(prev, [3, 3], greedy)
    assert [(r.num_tokens, len(r.spec_token_ids)) for r in ahead.scheduled] == [(2, 1)] * 2
    s.config.max_model_len = start
    assert s.schedule_ahead(prev, [3, 3], greedy) is None


def test_a_step_ahead_admits_the_requests_the_device_can_verify():
    """A free slot admits waiting requests in a step ahead, behind the predecessor's requests (their
    prompts are known), while the runner's test accepts them (plain greedy: verified on the device);
    where the next waiting request is refused, no step goes ahead (the next `schedule` admits it)."""
    def drafting_batch(s):
        for i in range(2):
            s.add_request(Request(f"a{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=40, temperature=0)))
        step(s)
        prev = s.schedule()
        for r in prev.scheduled:
            r.spec_token_ids = [9, 9]
            r.num_tokens += 2
        return prev

    s = scheduler(3)
    prev = drafting_batch(s)
    s.add_request(Request("sampled", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0)))
    assert s.schedule_ahead(prev, [3, 3], greedy) is None
    assert [r.request_id for r in s.waiting] == ["sampled"]

    s = scheduler(3)
    prev = drafting_batch(s)
    s.add_request(Request("g0", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0)))
    s.add_request(Request("g1", [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0)))  # no slot left
    ahead = s.schedule_ahead(prev, [3, 3], greedy)
    assert [(r.request.request_id, r.start, r.num_tokens, r.sample) for r in ahead.scheduled] == [
        ("a0", 8, 4, True), ("a1", 8, 4, True), ("g0", 0, 3, True)]
    assert ahead.num_batched_tokens == 4 + 4 + 3
    assert s.requests["g0"].status == RequestStatus.RUNNING and [r.request_id for r in s.waiting] == ["g1"]

    # admitted up to the budget: the rest of a long prompt is a later step's (that step samples nothing)
    s = scheduler(3)
    prev = drafting_batch(s)
    s.config.max_num_batched_tokens = 10
    s.add_request(Request("long", list(range(1, 9)), SamplingParams(max_tokens=8, temperature=0)))
    ahead = s.schedule_ahead(prev, [3, 3], greedy)
    assert [(r.request.request_id, r.num_tokens, r.sample) for r in ahead.scheduled][-1] == ("long", 2, False)
