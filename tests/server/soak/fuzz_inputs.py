"""Phase 4's inputs: raw JSON text (`Raw`, `dumps`), the hypothesis strategies that generate and mutate
WS frames and OpenAI bodies, and the known poison inputs (`POISON`)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from tests.server.soak.common import PROMPT_CHARS

# Inputs are raw JSON text, so they can hold what json.dumps cannot write: `Raw` pieces (NaN,
# Infinity, 5000-digit integers, lone-surrogate escapes, deep nesting) are pasted in verbatim.


@dataclass(frozen=True, slots=True)
class Raw:
    text: str


def dumps(obj) -> str:
    """JSON text of `obj`, with `Raw` pieces pasted verbatim (strings ASCII-escaped: "\\ud800")."""
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in obj) + "]"
    return json.dumps(obj)


BIG_DIGITS = "1" + "0" * 4999  # 10**4999: Python's json refuses integers over 4300 digits
WEIRD_VALUES = [
    None, True, False, 0, -1, 1.5, -0.0, "", " ", "\x00", "\ud800", "a\udfffb", "é" * 8, "\n\n", "x" * 3000,
    [], {}, [1, "a"], {"x": 1}, [[[]]], 10 ** 30, -10 ** 30, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 2 ** 1000,
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw(BIG_DIGITS), Raw("-" + BIG_DIGITS),
    Raw('"\\ud800"'), Raw('"x\\udc00"'), Raw('"\\u0000"'), Raw("[" * 60 + "]" * 60), Raw("[" * 5000 + "]" * 5000),
    Raw('{"a": ' * 300 + "1" + "}" * 300), "bogus", "response.create", -16, 17, 10 ** 6,
]
WS_FIELDS = ["prompt", "messages", "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "ignore_eos", "n", "cache_salt", "metadata", "role", "content", "type", "text", "event_id", "bogus"]
HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "n", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
               "min_tokens", "stop_token_ids", "repetition_penalty", "cache_salt", "role", "content", "echo",
               "best_of", "logit_bias", "tools", "response_format", "bogus"]
CONTENT_TYPES = ["application/json", "application/json", "application/json; charset=utf-8", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data"]


def strategies():
    """Hypothesis strategies (imported lazily: only the fuzz needs hypothesis)."""
    from hypothesis import strategies as st

    text = st.text(alphabet=PROMPT_CHARS, min_size=1, max_size=30)
    ids = st.lists(st.integers(3, 300), min_size=1, max_size=16)
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                               "content": text}), min_size=1, max_size=3)
    weird = st.one_of(st.sampled_from(WEIRD_VALUES), st.integers(), st.floats(), st.text(max_size=12),
                      st.lists(st.integers(-5, 400), max_size=4))
    sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "seed": st.integers(0, 2 ** 32),
                "stop": st.one_of(text, st.lists(text, max_size=3)), "ignore_eos": st.booleans(),
                "n": st.integers(1, 3), "cache_salt": st.text(max_size=8)}
    ws_params = st.one_of(*(st.fixed_dictionaries(head | {"max_output_tokens": st.integers(1, 6)},
                                                  optional=sampling | {
        "top_k": st.integers(-1, 40), "min_p": st.floats(0, 1),
        "metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)})
        for head in ({"prompt": st.one_of(text, ids)}, {"messages": messages})))
    ws_valid = st.one_of(
        st.fixed_dictionaries({"type": st.just("response.create"), "response": ws_params},
                              optional={"event_id": st.text(max_size=12)}),
        st.fixed_dictionaries({"type": st.just("response.cancel"), "response_id": st.text(max_size=24)}))
    http_common = {"max_tokens": st.integers(1, 6), "stream": st.booleans()}
    completions_valid = st.fixed_dictionaries(
        {"prompt": st.one_of(text, ids, st.lists(text, min_size=1, max_size=3))} | http_common,
        optional=sampling | {"logprobs": st.integers(0, 3), "model": st.just("tiny")})
    chat_valid = st.fixed_dictionaries({"messages": messages} | http_common,
                                       optional=sampling | {"logprobs": st.booleans(), "model": st.just("tiny")})

    @st.composite
    def mutated(draw, base, names):
        obj = draw(base)
        for _ in range(draw(st.integers(1, 3))):
            paths = list(_paths(obj))
            path = draw(st.sampled_from(paths))
            op = draw(st.sampled_from(["replace", "replace", "add", "delete"]))
            target = _get(obj, path)
            if op == "add" and isinstance(target, dict):
                obj = _put(obj, path + (draw(st.sampled_from(names)),), draw(weird))
            elif op == "delete" and path:
                obj = _put(obj, path, _DELETE)
            else:
                obj = _put(obj, path, draw(weird))
        return obj

    def frames(base, names):
        text_of = st.one_of(base, mutated(base, names)).map(dumps)
        return st.one_of(text_of, text_of.flatmap(  # text-level damage: cut short, garbage appended
            lambda t: st.one_of(st.integers(0, len(t)).map(lambda i: t[:i]),
                                st.text(max_size=8).map(lambda g: t + g))), st.text(max_size=40))

    def bodies(base):
        return st.tuples(st.sampled_from(CONTENT_TYPES), frames(base, HTTP_FIELDS).map(
            lambda t: t.encode("utf-8", "surrogatepass")))

    return {"ws": frames(ws_valid, WS_FIELDS), "completions": bodies(completions_valid),
            "chat": bodies(chat_valid)}


_DELETE = object()


def _paths(obj, prefix: tuple = ()):
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _get(obj, path: tuple):
    for k in path:
        obj = obj[k]
    return obj


def _put(obj, path: tuple, value):
    """A copy of `obj` with the value at `path` replaced (or deleted: `_DELETE`)."""
    if not path:
        return value
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    head = path[0]
    if len(path) == 1 and value is _DELETE:
        del copy[head]
    else:
        copy[head] = _put(copy[head] if head in (copy if isinstance(copy, dict) else range(len(copy))) else {},
                          path[1:], value)
    return copy


def _frame(response: dict, event_id: str | Raw = "p") -> str:
    return dumps({"type": "response.create", "event_id": event_id, "response": response})


def _body(obj: dict, content_type: str = "application/json") -> tuple[str, bytes]:
    return content_type, dumps(obj).encode()


_HI = {"prompt": "hi", "max_output_tokens": 4}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_COMPLETION = {"prompt": "hi", "max_tokens": 4}
# name -> (target, input, must be refused): the known poison inputs, also explicit examples of the fuzz
POISON = {
    "ws-seed-2**64": ("ws", _frame(_HI | {"seed": 2 ** 64}), True),
    "ws-seed-2**63": ("ws", _frame(_HI | {"seed": 2 ** 63}), False),
    "ws-surrogate-prompt": ("ws", _frame(_HI | {"prompt": Raw('"a\\ud800b"')}), True),
    "ws-surrogate-messages": ("ws", _frame({"messages": [{"role": "user", "content": Raw('"\\ud800"')}],
                                           "max_output_tokens": 4}), True),
    "ws-surrogate-metadata": ("ws", _frame(_HI | {"metadata": {"k": Raw('"\\ud800"')}}), True),
    "ws-surrogate-event-id": ("ws", _frame(_HI, Raw('"\\ud800"')), True),
    "ws-5000-digit-int": ("ws", _frame(_HI | {"max_output_tokens": Raw(BIG_DIGITS)}), True),
    "ws-role-bogus": ("ws", _frame({"messages": [{"role": "bogus", "content": "hi"}], "max_output_tokens": 4}),
                      True),
    "ws-temperature-infinity": ("ws", _frame(_HI | {"temperature": Raw("Infinity")}), True),
    "completions-seed-2**64": ("completions", _body(_COMPLETION | {"seed": 2 ** 64}), True),
    "completions-seed-2**63": ("completions", _body(_COMPLETION | {"seed": 2 ** 63}), False),
    "completions-surrogate-prompt": ("completions", _body(_COMPLETION | {"prompt": Raw('"\\ud800"')}), True),
    "completions-5000-digit-int": ("completions", _body(_COMPLETION | {"max_tokens": Raw(BIG_DIGITS)}), True),
    "completions-text-plain": ("completions", _body(_COMPLETION, "text/plain"), True),
    "completions-temperature-infinity": ("completions", _body(_COMPLETION | {"temperature": Raw("Infinity")}),
                                         True),
    "completions-1000-prompts-n16": ("completions", _body({"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 16}),
                                     True),
    "chat-seed-2**64": ("chat", _body(_CHAT | {"seed": 2 ** 64}), True),
    "chat-seed-2**63": ("chat", _body(_CHAT | {"seed": 2 ** 63}), False),
    "chat-surrogate-content": ("chat", _body({"messages": [{"role": "user", "content": Raw('"\\ud800"')}],
                                              "max_tokens": 4}), True),
    "chat-5000-digit-int": ("chat", _body(_CHAT | {"max_tokens": Raw(BIG_DIGITS)}), True),
    "chat-text-plain": ("chat", _body(_CHAT, "text/plain"), True),
    "chat-role-bogus": ("chat", _body({"messages": [{"role": "bogus", "content": "hi"}], "max_tokens": 4}), True),
    "chat-temperature-infinity": ("chat", _body(_CHAT | {"temperature": Raw("Infinity")}), True),
}
