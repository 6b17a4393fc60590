"""Tools and tool calls reach the chat template: as they are where the template renders them (arguments
as dicts, as HF templates use them), in the Hermes format where it does not (engine/tool_prompt.py)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specserve.engine.intake import Intake, PromptError
from specserve.server.tool_parsers import ToolCall, make_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
# renders tools and calls the way Qwen2.5's and Llama 3.1's templates do (fields of dict arguments)
TOOL_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                 "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
                 "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} city={{ c.function.arguments.city }}>"
                 "{% endfor %}{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}{% endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"  # like SmolLM2's


@pytest.fixture()
def intake(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    return Intake(tokenizer, len(tokenizer), 4096)


def test_a_template_that_renders_tools_gets_them_as_they_are(intake):
    intake.tokenizer.chat_template = TOOL_TEMPLATE
    assert intake.apply_chat_template(CHAT, TOOLS) == (
        "<tools>get_weather;</tools>[user]Weather in Paris?[assistant]<call get_weather city=Paris>"
        "[tool]sunny(answers call_1)")


def test_a_template_without_tools_gets_them_in_the_hermes_format(intake):
    intake.tokenizer.chat_template = PLAIN_TEMPLATE
    text = intake.apply_chat_template(CHAT, TOOLS)
    system, user, call, result = text.split("\n[")
    assert system.startswith("[system]# Tools") and '"name": "get_weather"' in system and "<tool_call>" in system
    assert user == "user]Weather in Paris?"
    assert make_parser("hermes").parse(call.removeprefix("assistant]")) == \
        (None, [ToolCall("get_weather", '{"city": "Paris"}')])  # what the hermes parser reads back
    assert result == "tool]sunny\n"
    own = intake.apply_chat_template([{"role": "system", "content": "Be brief."}] + CHAT[:1], TOOLS)
    assert own.startswith("[system]Be brief.\n\n# Tools") and own.count("[system]") == 1
    assert "# Tools" not in intake.apply_chat_template(CHAT[:1])  # no tools: nothing added


def test_tool_call_arguments_must_be_json(intake):
    bad = dict(CALL, function={"name": "get_weather", "arguments": "{city: Paris}"})
    with pytest.raises(PromptError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not JSON"):
        intake.chat([CHAT[0], {"role": "assistant", "tool_calls": [bad]}])
