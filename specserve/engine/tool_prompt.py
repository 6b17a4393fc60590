"""Tools and tool calls in chat messages, as chat templates take them.

Messages arrive in OpenAI's shape: an assistant message's `tool_calls` carry their arguments as JSON
text, which HF templates expect as dicts (`tool_call.function.arguments | tojson`), so they are parsed
here (vLLM does the same). A template that renders tools gets them as they are (`tools=`).

A template that never mentions `tools` (SmolLM2's, many base templates) would leave the model blind
to them, and one that never mentions `tool_calls` would drop earlier calls from the prompt. vLLM
leaves it there; here such a template gets them written in the Hermes format instead: the tools as a
system message (appended to the conversation's own system message, if any), and an assistant
message's calls as `<tool_call>` lines of its content — what the `hermes` parser reads back.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Copies of `messages` with each tool call's arguments as a dict; ValueError for arguments that
    are not JSON."""
    out = []
    for i, message in enumerate(messages):
        m = dict(message)
        if m.get("tool_calls"):
            m["tool_calls"] = [_with_parsed_arguments(call, f"messages[{i}].tool_calls[{j}]")
                               for j, call in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def _with_parsed_arguments(call: dict, where: str) -> dict:
    call = dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments is not JSON: {e}") from None
    elif args is None:
        function["arguments"] = {}
    call["function"] = function
    return call


def renders_tools(template: str) -> bool:
    return "tools" in template


def renders_tool_calls(template: str) -> bool:
    return "tool_calls" in template


def with_hermes_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools as a Hermes system prompt: appended to a leading system message, else one before all."""
    text = HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def with_hermes_calls(messages: list[dict]) -> list[dict]:
    """Assistant messages' tool calls written into their content as `<tool_call>` blocks."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"].get("name"), "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m.get('content') or ''}\n{text}".lstrip("\n")
        out.append(m)
    return out
