"""Tool-call parsing: every supported format, the error rules, and reasoning stripping."""

from __future__ import annotations

import itertools
import json

import pytest

from areal_agents.serve.toolcall import ParsedOutput, new_call_id, parse_tool_calls


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text, **kwargs):
    return parse_tool_calls(text, id_factory=ids(), **kwargs)


def call(name, arguments, call_id="call_0"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# --- Hermes / Qwen -----------------------------------------------------------------------------


def test_plain_text_has_no_calls():
    out = parse("  The answer is 4.  ")
    assert out == ParsedOutput(content="The answer is 4.", tool_calls=[], reasoning=None, errors=[])


def test_hermes_single_call_keeps_the_models_argument_text():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1,  "b": [2, 3]}}\n</tool_call>'
    out = parse(text)
    assert out.tool_calls == [call("add", '{"a": 1,  "b": [2, 3]}')]
    assert out.content is None
    assert out.errors == []
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": [2, 3]}


def test_hermes_multiple_calls_with_text_around():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": "é"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "parameters": {}}\n</tool_call>\nDone.'
    )
    out = parse(text)
    assert out.tool_calls == [call("a", '{"x": "é"}'), call("b", "{}", "call_1")]
    assert out.content == "Let me check both.\n\n\nDone."


def test_hermes_missing_closing_tag_at_the_end_is_tolerated():
    out = parse('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n')
    assert out.tool_calls == [call("add", '{"a": 1}')]
    assert out.content == "Sure."
    assert out.errors == []


def test_hermes_missing_closing_tag_before_the_next_call():
    text = '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": {}}'
    assert [c["function"]["name"] for c in parse(text).tool_calls] == ["a", "b"]


def test_trailing_end_of_turn_token_is_ignored():
    out = parse('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><|im_end|>')
    assert out.content is None and len(out.tool_calls) == 1


def test_arguments_given_as_a_json_string():
    out = parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert out.tool_calls == [call("a", '{"x": 1}')]


def test_missing_arguments_become_an_empty_object():
    assert parse('<tool_call>{"name": "a"}</tool_call>').tool_calls == [call("a", "{}")]


# --- errors --------------------------------------------------------------------------------------


def test_invalid_json_stays_in_content_with_a_positioned_error():
    text = 'Hi <tool_call>{"name": "a" "arguments": {}}</tool_call>'
    out = parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.errors == ["invalid JSON in <tool_call> at char 27: Expecting ',' delimiter"]
    assert text[27] == '"'


def test_a_bad_call_does_not_spoil_the_good_ones():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {]}</tool_call>'
    )
    out = parse(text)
    assert [c["function"]["name"] for c in out.tool_calls] == ["a"]
    assert out.content == '<tool_call>{"name": "b", "arguments": {]}</tool_call>'
    assert len(out.errors) == 1 and out.errors[0].startswith("invalid JSON in <tool_call> at char")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>  </tool_call>", "empty <tool_call> at char 11"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name" in <tool_call> at char 11'),
        (
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            "tool call 'a' at char 11: \"arguments\" must be a JSON object, not a list",
        ),
        (
            '<tool_call>{"name": "a", "arguments": "nope"}</tool_call>',
            "tool call 'a' at char 11: \"arguments\" is a string but not JSON (Expecting value)",
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}}</tool_call>',
            "unexpected text after the JSON in <tool_call> at char 41",  # the third '}'
        ),
        (
            "<tool_call>[1, 2]</tool_call>",
            "expected a JSON object in <tool_call>, not a list at char 11",
        ),
    ],
)
def test_unusable_calls_are_reported(text, error):
    out = parse(text)
    assert out.errors == [error]
    assert out.tool_calls == []
    assert out.content == text.strip()


def test_unknown_tool_is_returned_and_reported():
    out = parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', tool_names=["add", "mul"])
    assert out.tool_calls == [call("rm", "{}")]
    assert out.errors == ["unknown tool 'rm' at char 11; known tools: add, mul"]


def test_known_tool_gives_no_error():
    assert parse('<tool_call>{"name": "add"}</tool_call>', tool_names=["add"]).errors == []


# --- other formats -------------------------------------------------------------------------------


def test_mistral_json_list_keeps_ids_given_by_the_model():
    text = (
        'Checking. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abc123xyz"}, '
        '{"name": "b", "arguments": {"q": [1, 2]}}]</s>'
    )
    out = parse(text)
    assert out.content == "Checking."
    assert out.tool_calls == [call("a", '{"x": 1}', "abc123xyz"), call("b", '{"q": [1, 2]}')]


def test_mistral_args_marker_format():
    out = parse('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]k9[ARGS]{"y": 2}')
    assert out.tool_calls == [call("a", '{"x": 1}'), call("b", '{"y": 2}', "k9")]
    assert out.content is None


def test_mistral_invalid_json_is_reported():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {]'
    out = parse(text)
    assert out.tool_calls == []
    assert out.content == text
    position = text.index("]", 12)
    assert out.errors == [
        f"invalid JSON in [TOOL_CALLS] at char {position}: "
        "Expecting property name enclosed in double quotes"
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": {"x": 1}}',
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}',
        '  {"type": "function", "name": "a", "arguments": {"x": 1}}\n',
    ],
)
def test_llama_whole_message_json(text):
    out = parse(text)
    assert out.tool_calls == [call("a", '{"x": 1}')]
    assert out.content is None


def test_llama_list_of_calls():
    out = parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert out.tool_calls == [call("a", '{"x": 1}'), call("b", "{}", "call_1")]


@pytest.mark.parametrize(
    "text",
    ['{"answer": 42}', '{"name": "a"}', "[1, 2]", '{"name": "a", "parameters":', "{not json}"],
)
def test_json_content_that_is_not_a_call_stays_content(text):
    out = parse(text)
    assert out.tool_calls == [] and out.errors == [] and out.content == text


def test_function_tags():
    out = parse('Calling <function=a>{"x": 1}</function> and <function=b>{"y": 2}')
    assert out.tool_calls == [call("a", '{"x": 1}'), call("b", '{"y": 2}', "call_1")]
    assert out.content == "Calling  and"


def test_function_tag_with_xml_parameters_inside_tool_call():
    text = (
        "<tool_call>\n<function=search>\n<parameter=query>\nred shoes\n</parameter>\n"
        "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>"
    )
    out = parse(text)
    assert out.tool_calls == [call("search", '{"query": "red shoes", "limit": 5}')]


def test_function_tag_with_non_object_arguments():
    out = parse("<function=a>[1]</function>")
    assert out.errors == ["<function=a> at char 0: arguments must be a JSON object, not a list"]
    assert out.content == "<function=a>[1]</function>"


# --- reasoning -----------------------------------------------------------------------------------


def test_think_block_is_split_off():
    text = (
        "<think>\nThe user wants a sum.\n<tool_call>ignored</tool_call>\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    out = parse(text)
    assert out.reasoning == "The user wants a sum.\n<tool_call>ignored</tool_call>"
    assert out.tool_calls == [call("add", '{"a": 1}')]
    assert out.content is None and out.errors == []


def test_empty_think_block_gives_no_reasoning():
    out = parse("<think>\n\n</think>\n\nHello")
    assert out.reasoning is None and out.content == "Hello"


def test_close_tag_only_when_the_prompt_opened_the_block():
    out = parse("It is 4.\n</think>\n\nFour.")
    assert out.reasoning == "It is 4." and out.content == "Four."


def test_unclosed_think_block_is_all_reasoning():
    out = parse("<think>\nStill thinking about")
    assert out.reasoning == "Still thinking about" and out.content is None


def test_error_positions_count_from_the_start_of_the_whole_text():
    text = '<think>x</think><tool_call>{"name": 1}</tool_call>'
    assert parse(text).errors == [f'missing "name" in <tool_call> at char {text.index("{")}']


# --- the result --------------------------------------------------------------------------------


def test_to_message_is_an_openai_assistant_message():
    out = parse('<think>r</think>Hi <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert out.to_message() == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "r",
        "tool_calls": [call("a", "{}")],
    }
    assert ParsedOutput(content=None).to_message() == {"role": "assistant", "content": None}


def test_default_ids_are_random_hex():
    first = parse_tool_calls('<tool_call>{"name": "a"}</tool_call>').tool_calls[0]["id"]
    assert first.startswith("call_") and len(first) == 29
    int(first.removeprefix("call_"), 16)
    assert new_call_id() != new_call_id()


def test_non_string_input_is_a_type_error():
    with pytest.raises(TypeError, match="expected the generated text as str"):
        parse_tool_calls(None)  # type: ignore[arg-type]


def test_a_model_that_nests_json_too_deeply_gets_a_parse_error_not_a_crash():
    deep = "[" * 5000 + "]" * 5000
    for text in (
        f'<tool_call>\n{{"name": "f", "arguments": {deep}}}\n</tool_call>',
        f'<tool_call>\n{{"name": "f", "arguments": "{deep}"}}\n</tool_call>',
    ):
        parsed = parse_tool_calls(text, tool_names=["f"])
        assert parsed.tool_calls == [] and "nested too deeply" in parsed.errors[0]
    assert parse_tool_calls(deep, tool_names=["f"]).tool_calls == []
