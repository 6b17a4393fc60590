"""Fuzz the WebSocket protocol and both OpenAI endpoints with hypothesis (tests/server/soak's strategies
and oracle): no 5xx, an answer within the timeout, one well-formed event per WS frame, no dropped socket,
a concurrent canary request still completes, nothing leaked. The known poison inputs are explicit
examples of each fuzz and also tests of their own (they must be refused: 400 / an `error` event).

CI size: SOAK_FUZZ_EXAMPLES inputs per endpoint (default 150, derandomized); full size:
`python bench/soak.py --full` (docs/soak.md)."""
from __future__ import annotations

import os

import pytest

from tests.server.harness import ServerThread, engine_factory
from tests.server.soak import FUZZ_SERVER, POISON, Fuzzer, run_fuzz

NUM_EXAMPLES = int(os.environ.get("SOAK_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def fuzzer(tiny_chat_dir):
    engine_args, settings = FUZZ_SERVER
    server = ServerThread(engine_factory(tiny_chat_dir, dtype="float32", device="cpu", **engine_args), "tiny",
                          **settings)
    fuzzer = Fuzzer(server)
    yield fuzzer
    fuzzer.close()
    server.stop()


@pytest.mark.parametrize("target", ["ws", "completions", "chat"])
def test_fuzz(fuzzer, target):
    fuzzer.take_problems()
    run_fuzz(fuzzer, target, NUM_EXAMPLES, derandomize=True)
    problems = fuzzer.take_problems()
    assert fuzzer.num_canaries > 0, "no canary request completed"
    assert not problems, f"{len(problems)} problems in {fuzzer.num_inputs[target]} {target} inputs:\n" + \
        "\n".join(problems[:30])


@pytest.mark.parametrize("name", sorted(POISON))
def test_poison_input_is_refused(fuzzer, name):
    target, case, must_refuse = POISON[name]
    fuzzer.take_problems()
    fuzzer.check(target, case, must_refuse)
    problems = fuzzer.take_problems()
    assert not problems, "\n".join(problems)
