"""EngineCore: the engine loop, whatever carries its messages.

It takes `messages.CoreInput` (adds, aborts, stops, shutdown) and, while any request is unfinished,
steps the engine and sends one `messages.StepOutput` per step to each front end with requests in it
(the new token ids of all of them; stats go to every front end). It runs in a thread
(async_engine.py, for an engine embedded in the caller's process) or in its own process
(core_process.py, the server's way); the loop is the same.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from specserve.engine.engine import LLMEngine
from specserve.engine.executor import ExecutorDeadError
from specserve.engine.messages import Abort, AddRequest, CoreInput, Shutdown, StepOutput, StopSample

logger = logging.getLogger(__name__)

Receive = Callable[[bool], list[CoreInput]]  # receive(block): the messages waiting (block: wait for one)
Send = Callable[[int, StepOutput], None]  # send(client, output)


class EngineCore:
    def __init__(self, engine: LLMEngine, num_clients: int = 1) -> None:
        self.engine = engine
        self.num_clients = num_clients
        self._client: dict[str, int] = {}  # request id -> the front end that streams it
        self._rejected: dict[str, str] = {}
        self.num_steps = 0

    def handle(self, msg: CoreInput) -> bool:
        """Apply one message; False once told to shut down."""
        engine = self.engine
        if isinstance(msg, AddRequest):
            self._client[msg.request_id] = msg.client
            try:
                # the front end's intake checked the params (engine/async_engine.py)
                engine.add_group(engine.make_requests(msg.request_id, {"prompt_token_ids": msg.prompt_token_ids},
                                                      msg.params, owner=msg.owner, arrival_time=msg.arrival_time,
                                                      checked=True))
            except ValueError as e:
                self._rejected[msg.request_id] = str(e)
        elif isinstance(msg, Abort):
            for req_id in msg.request_ids:
                engine.abort(req_id)
                self._client.pop(req_id, None)
        elif isinstance(msg, StopSample):
            engine.finish_sample(msg.sample_id, msg.stop)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def step(self) -> dict[int, StepOutput]:
        """One engine step (none if nothing is unfinished), split by front end."""
        engine = self.engine
        outs: dict[int, StepOutput] = {}

        def out_for(req_id: str) -> StepOutput:
            client = self._client.get(req_id, 0)
            if client not in outs:
                outs[client] = StepOutput([], {}, {})
            return outs[client]

        updates, failed = [], {}
        if engine.has_unfinished():
            try:
                updates = engine.step_updates()  # a step that raises is isolated inside: isolation.py
            except ExecutorDeadError:  # no step can run any more: the core stops (its front ends see why)
                raise
            except Exception as e:  # noqa: BLE001 - the isolation itself broke: fail all, keep serving
                logger.exception("engine step failed")
                for req_id in list(engine.groups):
                    engine.abort(req_id)
                    failed[req_id] = f"engine step failed: {e}"
            self.num_steps += 1
        failed.update(engine.take_failures())
        for u in updates:
            out_for(u.request_id).updates.append(u)
            if u.request_id not in engine.groups:
                self._client.pop(u.request_id, None)  # its last update
        for req_id, why in failed.items():
            out_for(req_id).failed[req_id] = why
            self._client.pop(req_id, None)
        rejected, self._rejected = self._rejected, {}
        rejected.update(engine.take_rejections())  # grammars that did not compile
        for req_id, why in rejected.items():
            out_for(req_id).rejected[req_id] = why
            self._client.pop(req_id, None)
        stats = engine.stats()
        for client in range(self.num_clients):
            outs.setdefault(client, StepOutput([], {}, {})).stats = stats
        return outs

    def run(self, receive: Receive, send: Send) -> None:
        """Serve until a Shutdown arrives: take the waiting messages, step, send; block only while
        nothing is unfinished. Requests still running at shutdown are aborted (their blocks freed)."""
        engine = self.engine
        try:
            while True:
                running = True
                for msg in receive(not engine.has_unfinished()):
                    running = self.handle(msg) and running
                if not running:
                    break
                for client, out in self.step().items():
                    send(client, out)
        finally:
            for req_id in list(engine.groups):
                engine.abort(req_id)
