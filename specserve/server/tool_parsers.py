"""Tool calls out of a model's text, streamed or whole: the formats of the families we serve.

- `hermes` (Hermes, Qwen2/2.5, and the fallback prompt of engine/tool_prompt.py):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them is content.
- `llama3_json` (Llama 3.1/3.2): the output is JSON calls `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`, several separated by `;`); output that starts otherwise is content.
- `required` (tool_choice "required", grammar-constrained): a JSON array of call objects.
- `named` (tool_choice naming a function, grammar-constrained): the whole output is its arguments.

Every parser reads text a character at a time, so a delta may end anywhere (inside a tag, a key, a
string escape). `feed(text)` returns what can be told now (content text and call deltas: a call's
first delta carries its name, later ones argument fragments); `finish()` flushes what was held back.
`parse(text)` runs the same machine over a whole output, so a streamed answer and a whole one agree;
a whole output whose calls do not hold together (unterminated, arguments that are not JSON) is
content, as vLLM answers it. Arguments are the model's JSON text of the value, as written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
PARSERS = ("hermes", "llama3_json")


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # the call's position in the message
    name: str | None  # set on the call's first delta only
    arguments: str  # the next fragment of its arguments' JSON text ("" on the first delta)


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


class _CallObject:
    """One call object `{"name": "...", "arguments" | "parameters": VALUE, ...}` read a character at a
    time; the value's text is collected verbatim as the arguments. Other keys are skipped."""

    def __init__(self) -> None:
        self.depth = 0  # 1 = inside the call object
        self.in_string = self.escaped = False
        self.want_value = False  # at depth 1: after a key's ':'
        self.key: str | None = None
        self.reading: str | None = None  # the depth-1 string being read: "key" | "name" | None (skipped)
        self.chars: list[str] = []
        self.name: str | None = None
        self.args: list[str] = []  # the arguments' text, a character at a time
        self.capturing = False
        self.arg_depth = 0
        self.arg_string = self.arg_escaped = False
        self.has_args = self.done = self.broken = False

    def feed(self, ch: str) -> None:
        if self.done or self.broken:
            return
        if self.capturing and self._capture(ch):
            return
        if self.depth == 0:
            if ch == "{":
                self.depth = 1
            elif not ch.isspace():
                self.broken = True
            return
        if self.in_string:
            self._string_char(ch)
        elif self.depth > 1:  # inside a skipped value
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
        elif self.want_value and self.key in ARGUMENT_KEYS and not ch.isspace() and ch not in ",}":
            self.capturing, self.has_args, self.want_value = True, True, False
            self._capture(ch)
        elif ch == '"':
            self.in_string, self.chars = True, []
            self.reading = "key" if not self.want_value else ("name" if self.key == "name" else None)
        elif ch == ":":
            self.want_value = True
        elif ch == ",":
            self.want_value, self.key = False, None
        elif ch == "}":
            self.done = True
        elif ch in "{[":
            self.depth += 1

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            text = _json_string("".join(self.chars))
            if self.reading == "key":
                self.key = text
            elif self.reading == "name":
                self.name = text
            self.reading = None
            return
        if self.reading is not None:
            self.chars.append(ch)

    def _capture(self, ch: str) -> bool:
        """Take `ch` into the arguments' text; False when it ends a scalar value (and is not part of it)."""
        if self.arg_string:
            self.args.append(ch)
            if self.arg_escaped:
                self.arg_escaped = False
            elif ch == "\\":
                self.arg_escaped = True
            elif ch == '"':
                self.arg_string = False
                self.capturing = self.arg_depth > 0
            return True
        if ch in "{[":
            self.arg_depth += 1
        elif ch in "}]":
            if self.arg_depth == 0:  # the call object closes right after a scalar value
                self.capturing = False
                return False
            self.arg_depth -= 1
        elif ch == '"':
            self.arg_string = True
        elif self.arg_depth == 0 and (ch == "," or ch.isspace()):
            self.capturing = False
            return False
        self.args.append(ch)
        if self.arg_depth == 0 and ch in "}]":
            self.capturing = False
        return True

    def call(self) -> ToolCall | None:
        """The call, if the object is complete and its arguments are JSON."""
        if not self.done or not self.name:
            return None
        args = "".join(self.args) if self.has_args else "{}"
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(self.name, args)


def _json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


class _Calls:
    """The call objects of one message and what of them has been handed out."""

    def __init__(self) -> None:
        self.objects: list[_CallObject] = []
        self._sent: list[int] = []  # argument characters handed out per call; -1: not announced yet

    def start(self) -> _CallObject:
        self.objects.append(_CallObject())
        self._sent.append(-1)
        return self.objects[-1]

    def drain(self, final: bool = False) -> list[ToolCallDelta]:
        out = []
        for i, obj in enumerate(self.objects):
            if obj.name is None:
                continue
            if self._sent[i] < 0:
                out.append(ToolCallDelta(i, obj.name, ""))
                self._sent[i] = 0
            text = "".join(obj.args[self._sent[i]:])
            if final and obj.done and not obj.has_args and self._sent[i] == 0:
                text = "{}"  # a call written without arguments
            if text:
                out.append(ToolCallDelta(i, None, text))
                self._sent[i] += len(text) if obj.has_args else 0
        return out

    def complete(self) -> list[ToolCall] | None:
        calls = [obj.call() for obj in self.objects]
        return None if any(c is None for c in calls) else calls


class ToolParser:
    """The streaming protocol of every format: `feed` deltas, `finish` once; `parse` a whole output."""

    def __init__(self) -> None:
        self.calls = _Calls()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        for ch in text:
            out.content += self._char(ch)
        out.calls = self.calls.drain()
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta(self._flush(), self.calls.drain(final=True))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, the calls) of a whole output; the text as content if its calls are broken."""
        content = self.feed(text).add(self.finish()).content
        calls = self.calls.complete()
        if calls is None:
            return text, []
        return content or None, calls

    def _char(self, ch: str) -> str:
        raise NotImplementedError

    def _flush(self) -> str:
        return ""


class _Content:
    """Content text outside the calls: a stretch that is only whitespace (between calls, around them)
    is dropped; any other stretch is kept as written. Trailing whitespace waits to see which."""

    def __init__(self) -> None:
        self.held = ""
        self.has_text = False

    def add(self, text: str) -> str:
        stripped = text.rstrip()
        if not stripped:
            self.held += text
            return ""
        out = self.held + stripped
        self.held, self.has_text = text[len(stripped):], True
        return out

    def close(self) -> str:
        out = self.held if self.has_text else ""
        self.held, self.has_text = "", False
        return out


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text that may be the start of a tag
        self.content = _Content()
        self.current: _CallObject | None = None
        self.tail = ""
        self.raw: list[str] = []  # the current call's text: content after all if it never names a function

    def _char(self, ch: str) -> str:
        if self.current is not None:
            self.current.feed(ch)
            self.raw.append(ch)
            self.tail = (self.tail + ch)[-len(self.END):]
            if self.tail != self.END:
                return ""
            if not self.current.done:
                self.current.broken = True
            return self._end_call()
        self.pending += ch
        if self.pending == self.START:
            self.pending, self.current, self.raw = "", self.calls.start(), [self.START]
            return self.content.close()
        if self.START.startswith(self.pending):
            return ""
        cut = next((i for i in range(1, len(self.pending)) if self.START.startswith(self.pending[i:])),
                   len(self.pending))
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return self.content.add(text)

    def _end_call(self) -> str:
        """Nothing, or the call's text when no function was named (streamed calls cannot be taken back)."""
        unnamed, self.current, self.tail = self.current.name is None, None, ""
        return self.content.add("".join(self.raw)) if unnamed else ""

    def _flush(self) -> str:
        text = self.content.add(self.pending) if self.current is None else self._end_call()
        self.pending = ""
        return text + self.content.close()


class Llama3JsonToolParser(ToolParser):
    BOT = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | calls | content
        self.pending = ""
        self.current: _CallObject | None = None

    def _char(self, ch: str) -> str:
        if self.state == "content":
            return ch
        if self.state == "start":
            self.pending += ch
            head = self.pending.lstrip()
            if head == self.BOT:
                self.state, self.pending = "calls", ""
            elif not head or self.BOT.startswith(head):
                pass
            elif head.startswith("{"):
                self.state, self.pending = "calls", ""
                self.current = self.calls.start()
                self.current.feed("{")
            else:
                self.state, text, self.pending = "content", self.pending, ""
                return text
            return ""
        if self.current is not None and not self.current.done and not self.current.broken:
            self.current.feed(ch)
            return ""
        if ch.isspace() or ch == ";":
            return ""
        if ch == "{":
            self.current = self.calls.start()
            self.current.feed(ch)
            return ""
        self.state = "content"  # text after the calls
        return ch

    def _flush(self) -> str:
        text, self.pending = (self.pending if self.pending.strip() else ""), ""
        return text


class RequiredToolParser(ToolParser):
    """tool_choice "required": the grammar makes the output a JSON array of call objects."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | array | end
        self.current: _CallObject | None = None

    def _char(self, ch: str) -> str:
        if self.current is not None and not self.current.done and not self.current.broken:
            self.current.feed(ch)
        elif self.state == "start" and ch == "[":
            self.state = "array"
        elif self.state == "array" and ch == "{":
            self.current = self.calls.start()
            self.current.feed(ch)
        elif self.state == "array" and ch == "]":
            self.state = "end"
        return ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = super().parse(text)
        return (content, calls) if calls and self.state == "end" else (text, [])


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the grammar makes the whole output its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.calls.start().name = name
        self.obj = self.calls.objects[0]
        self.obj.has_args = self.obj.done = True

    def _char(self, ch: str) -> str:
        self.obj.args.append(ch)
        return ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        self.feed(text)
        return None, [ToolCall(self.obj.name, text)]


def make_parser(kind: str, name: str | None = None) -> ToolParser:
    """`kind`: hermes | llama3_json (tool_choice auto), required, or named (with the function's `name`)."""
    if kind == "hermes":
        return HermesToolParser()
    if kind == "llama3_json":
        return Llama3JsonToolParser()
    if kind == "required":
        return RequiredToolParser()
    if kind == "named":
        return NamedToolParser(name)
    raise ValueError(f"unknown tool call parser {kind!r}; choose one of {', '.join(PARSERS)}")
