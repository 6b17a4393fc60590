"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, how each choice is
honoured, and tool calls as OpenAI returns them (whole, or as streamed deltas).

- `none`: the tools go to the chat template, the output is text.
- `auto` (the default when tools are given): the model decides; its text is parsed by the server's
  parser (`--tool-call-parser hermes | llama3_json`, which needs `--enable-auto-tool-choice`, as in
  vLLM; without them `auto` is a 400).
- `required`: a grammar makes the output a JSON array of calls `{"name", "parameters"}` of the given
  tools (each item's parameters follow that tool's schema), as vLLM does; at least one call.
- `{"type": "function", "function": {"name": N}}`: a grammar makes the output N's arguments.
`parallel_tool_calls: false` allows one call (the grammar's array holds one item; with `auto` the
first call is kept).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import StructuredOutputsParams
from specserve.server.tool_parsers import ToolCallDelta, ToolParser, make_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ToolChoiceError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are used: `kind` none | auto | required | named (`name`)."""

    kind: Literal["none", "auto", "required", "named"]
    tools: list[ToolDefinition]
    name: str | None = None
    parallel: bool = True

    def template_tools(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar `required` and a named choice are enforced with (a JSON schema)."""
        if self.kind == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.name)))
        if self.kind != "required":
            return None
        items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": _parameters(t)}, "required": ["name", "parameters"]}
                 for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parser(self, auto_parser: str | None) -> ToolParser | None:
        """A fresh parser for one choice's output (None: the output is plain text)."""
        if self.kind == "none":
            return None
        if self.kind == "auto":
            assert auto_parser is not None, "auto tool choice is refused without a parser"
            return make_parser(auto_parser)
        return make_parser(self.kind, self.name)

    def _tool(self, name: str) -> ToolDefinition:
        return next(t for t in self.tools if t.function.name == name)


def _parameters(tool: ToolDefinition) -> dict:
    return tool.function.parameters or EMPTY_PARAMETERS


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The plan for a request's `tools` / `tool_choice` (None: no tools); ToolChoiceError when they
    do not go together."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools: give the functions the model may call in `tools`",
                                  "tool_choice")
        return None
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if all(t.function.name != name for t in tools):
            names = ", ".join(t.function.name for t in tools)
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools "
                                  f"({names})", "tool_choice")
        return ToolPlan("named", tools, name, parallel)
    return ToolPlan(tool_choice, tools, None, parallel)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    """One choice's output through its parser: content text and OpenAI tool-call dicts, streamed or
    whole."""

    parser: ToolParser
    parallel: bool = True
    ids: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content, `delta.tool_calls` entries) for the next piece of text; `final` at the end."""
        out = self.parser.feed(text)
        if final:
            out.add(self.parser.finish())
        return out.content, [self._delta(d) for d in out.calls if self.parallel or d.index == 0]

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, `message.tool_calls`) of a whole output."""
        content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        self.ids = [new_call_id() for _ in calls]
        return content, [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for i, c in zip(self.ids, calls)]

    def _delta(self, d: ToolCallDelta) -> dict:
        if d.name is None:
            return {"index": d.index, "function": {"arguments": d.arguments}}
        self.ids.append(new_call_id())
        return {"index": d.index, "id": self.ids[-1], "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
