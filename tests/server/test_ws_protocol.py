"""The WebSocket protocol on the wire: a real uvicorn server, the real engine (tiny random model with a
character tokenizer), raw `websockets` frames."""
from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from specserve.server.protocol import parse_server_event
from tests.server.conftest import SMALL_FRAME


async def recv(ws, timeout: float = 30.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def connect(server):
    ws = await websockets.connect(server.ws, max_size=None)
    hello = await recv(ws)
    assert hello["type"] == "session.created"
    return ws, hello


async def create(ws, event_id: str, **response) -> str:
    await ws.send(json.dumps({"type": "response.create", "event_id": event_id, "response": response}))
    msg = await recv(ws)
    assert msg["type"] == "response.created", msg
    assert msg["event_id"] == event_id
    return msg["response"]["id"]


async def collect(ws, response_id: str) -> tuple[list[dict], dict]:
    deltas = []
    while True:
        msg = await recv(ws)
        if msg["type"] == "response.output_text.delta":
            assert msg["response_id"] == response_id
            deltas.append(msg)
        elif msg["type"] == "response.done":
            assert msg["response"]["id"] == response_id
            return deltas, msg["response"]
        else:
            raise AssertionError(msg)


def test_session_and_streaming(tiny_server):
    async def main():
        ws, hello = await connect(tiny_server)
        assert hello["model"] == "tiny" and hello["max_model_len"] == 256 and hello["speculative"] is None
        rid = await create(ws, "e1", prompt="Hello there", max_output_tokens=12, ignore_eos=True,
                           temperature=0, metadata={"tag": "x"})
        deltas, done = await collect(ws, rid)
        await ws.close()
        return deltas, done

    deltas, done = asyncio.run(main())
    # frames are coalesced (a frame carries every token since the last one sent): each token once
    assert sum(len(d["token_ids"]) for d in deltas) == 12 and 1 <= len(deltas) <= 12
    for d in deltas:
        parse_server_event(d)  # every frame matches its pydantic model
        assert d["token_ids"] and d["accepted_draft_tokens"] == 0
    assert done["status"] == "incomplete"  # finish_reason length
    assert done["output"][0]["finish_reason"] == "length"
    assert done["output"][0]["text"] == "".join(d["delta"] for d in deltas)
    assert done["usage"] == {"input_tokens": len("Hello there"), "output_tokens": 12, "cached_tokens": 0}
    assert done["metrics"]["ttft_ms"] > 0 and done["metrics"]["tokens_per_s"] > 0
    assert done["metrics"]["spec"] == {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    assert done["metadata"] == {"tag": "x"}


def test_concurrent_requests_multiplexed_on_one_socket(tiny_server):
    baseline = tiny_server.wait_blocks(0)["num_used_blocks"]

    async def main():
        ws, _ = await connect(tiny_server)
        specs = {f"e{i}": dict(prompt=[10 + i, 20, 30 + i], max_output_tokens=6 + 2 * i, ignore_eos=True,
                               temperature=0) for i in range(4)}
        specs["e4"] = dict(prompt="twice", max_output_tokens=5, ignore_eos=True, temperature=0.8, seed=3, n=2)
        for event_id, spec in specs.items():  # all sent before reading anything
            await ws.send(json.dumps({"type": "response.create", "event_id": event_id, "response": spec}))
        ids, order, deltas, done = {}, [], {}, {}
        while len(done) < len(specs):
            msg = await recv(ws)
            if msg["type"] == "response.created":
                ids[msg["response"]["id"]] = msg["event_id"]
            elif msg["type"] == "response.output_text.delta":
                order.append(msg["response_id"])
                deltas.setdefault((msg["response_id"], msg["output_index"]), []).extend(msg["token_ids"])
            elif msg["type"] == "response.done":
                done[msg["response"]["id"]] = msg["response"]
        await ws.close()
        return specs, ids, order, deltas, done

    specs, ids, order, deltas, done = asyncio.run(main())
    assert set(ids.values()) == set(specs)
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches >= 4, "responses should stream interleaved, not one after another"
    for rid, event_id in ids.items():
        spec = specs[event_id]
        for i in range(spec.get("n", 1)):
            assert len(deltas[(rid, i)]) == spec["max_output_tokens"]
        assert done[rid]["usage"]["output_tokens"] == spec["max_output_tokens"] * spec.get("n", 1)
        assert len(done[rid]["output"]) == spec.get("n", 1)
    assert tiny_server.wait_blocks(baseline)["num_used_blocks"] == baseline


def test_greedy_output_is_deterministic(tiny_server):
    async def main():
        ws, _ = await connect(tiny_server)
        out = []
        for k in range(2):
            rid = await create(ws, f"g{k}", prompt=[5, 6, 7, 8], max_output_tokens=8, temperature=0,
                               ignore_eos=True)
            deltas, _ = await collect(ws, rid)
            out.append([t for d in deltas for t in d["token_ids"]])
        await ws.close()
        return out

    a, b = asyncio.run(main())
    assert a == b and len(a) == 8


def test_chat_messages_and_stop_string(tiny_server):
    async def main():
        ws, _ = await connect(tiny_server)
        rid = await create(ws, "c", messages=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                           max_output_tokens=5, temperature=0, ignore_eos=True)
        _, chat = await collect(ws, rid)
        rid = await create(ws, "s", prompt=[5, 6, 7, 8], max_output_tokens=40, temperature=0, ignore_eos=True)
        _, free = await collect(ws, rid)
        stop = free["output"][0]["text"][3:5]
        rid = await create(ws, "t", prompt=[5, 6, 7, 8], max_output_tokens=40, temperature=0, ignore_eos=True,
                           stop=[stop])
        _, stopped = await collect(ws, rid)
        await ws.close()
        return chat, free, stop, stopped

    chat, free, stop, stopped = asyncio.run(main())
    # the template "system: be brief\nuser: hi\nassistant:" is 35 characters = 35 tokens, no BOS added
    assert chat["usage"]["input_tokens"] == len("system: be brief\nuser: hi\nassistant:")
    assert stopped["status"] == "completed" and stopped["output"][0]["finish_reason"] == "stop"
    assert stopped["output"][0]["text"] == free["output"][0]["text"][:free["output"][0]["text"].index(stop)]


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_cancel_and_disconnect_free_kv_blocks(tiny_server, how):
    baseline = tiny_server.wait_blocks(0)["num_used_blocks"]

    async def main():
        ws, _ = await connect(tiny_server)
        rid = await create(ws, "long", prompt=list(range(3, 60)), max_output_tokens=190, ignore_eos=True)
        for _ in range(3):
            assert (await recv(ws))["type"] == "response.output_text.delta"
        busy = tiny_server.stats()["num_used_blocks"]
        if how == "disconnect":
            await ws.close()
            return busy, None
        await ws.send(json.dumps({"type": "response.cancel", "event_id": "x", "response_id": rid}))
        while True:
            msg = await recv(ws)
            if msg["type"] == "response.done":
                break
        await ws.close()
        return busy, msg["response"]

    busy, done = asyncio.run(main())
    assert busy > baseline  # the request held KV blocks while it ran
    if done is not None:
        assert done["status"] == "cancelled"
        assert 3 <= done["usage"]["output_tokens"] < 190
    stats = tiny_server.wait_blocks(baseline)
    assert stats["num_used_blocks"] == baseline and stats["num_requests_running"] == 0


BAD_FRAMES = [
    ("{not json", "invalid_json"),
    ('["a", "list"]', "invalid_event"),
    ('{"type": "session.update"}', "unknown_event_type"),
    ('{"type": "response.create", "event_id": "b1", "response": {"prompt": "x", "temperature": "hot"}}',
     "invalid_event"),
    ('{"type": "response.create", "event_id": "b2", "response": {"prompt": [1, "2"]}}', "invalid_event"),
    ('{"type": "response.create", "event_id": "b3", "response": {"prompt": "x", "max_output_tokens": 0}}',
     "invalid_event"),
    ('{"type": "response.create", "event_id": "b4", "response": {"prompt": "x", "messages": []}}',
     "invalid_event"),
    ('{"type": "response.create", "event_id": "b5", "response": {"prompt": "x", "unknown_field": 1}}',
     "invalid_event"),
    ('{"type": "response.create", "event_id": "b6", "response": {"prompt": [5, 99999]}}', "invalid_prompt"),
    ('{"type": "response.create", "event_id": "b7", "response": {"prompt": ""}}', "invalid_prompt"),
    (json.dumps({"type": "response.create", "event_id": "b8", "response": {"prompt": [5] * 300}}),
     "context_length_exceeded"),
    ('{"type": "response.cancel", "event_id": "b9", "response_id": "resp-nope"}', "unknown_response_id"),
    ("x" * (SMALL_FRAME + 1), "frame_too_large"),
    (b'{"type": "response.create"}', "invalid_frame"),
]


def test_bad_frames_get_error_events_and_the_socket_stays_usable(tiny_server):
    async def main():
        ws, _ = await connect(tiny_server)
        seen = []
        for frame, code in BAD_FRAMES:
            await ws.send(frame)
            msg = await recv(ws)
            assert msg["type"] == "error", (frame[:60], msg)
            parse_server_event(msg)
            seen.append((msg["error"]["code"], code, msg["error"]["message"], msg["error"]["event_id"]))
        rid = await create(ws, "ok", prompt="still works", max_output_tokens=3, ignore_eos=True)
        _, done = await collect(ws, rid)
        await ws.close()
        return seen, done

    seen, done = asyncio.run(main())
    for got, want, message, _ in seen:
        assert got == want, message
        assert message
    assert [e for _, _, _, e in seen][3:6] == ["b1", "b2", "b3"]  # errors point at the client's event
    assert "300 tokens" in seen[10][2] and "256" in seen[10][2]
    assert done["status"] == "incomplete"


def test_frame_over_the_transport_cap_closes_only_that_socket(tiny_server):
    async def main():
        ws, _ = await connect(tiny_server)
        await ws.send("y" * (tiny_server.settings.hard_frame_limit + 1))
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
        ws2, _ = await connect(tiny_server)
        rid = await create(ws2, "after", prompt="ok", max_output_tokens=2, ignore_eos=True)
        _, done = await collect(ws2, rid)
        await ws2.close()
        return info.value, done

    closed, done = asyncio.run(main())
    assert closed.rcvd is not None and closed.rcvd.code == 1009  # "message too big"
    assert done["usage"]["output_tokens"] == 2
