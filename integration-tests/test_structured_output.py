"""Structured output end to end (issue 17), with the bundled SmolLM2 and the
real clients: every constrained output must parse and validate, whatever the
135M model would rather write. Content is not judged, only validity."""

from __future__ import annotations

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

ISO_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def client(launcher) -> OpenAI:
    return OpenAI(base_url=f"{launcher.base_url}/v1", api_key="unused", timeout=600)


@pytest.fixture(scope="module")
def http(launcher):
    with httpx.Client(base_url=launcher.base_url, timeout=600) as c:
        yield c


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    address: Address
    hobbies: list[str] = Field(max_length=3)
    nickname: Optional[str] = Field(default=None, max_length=16)


def test_pydantic_parse_gives_valid_objects_for_20_prompts(client):
    def parse(i: int):
        completion = client.chat.completions.parse(
            model="tgi",
            messages=[{"role": "user", "content": f"Describe person number {i} of a small town as JSON."}],
            response_format=Person,
            max_tokens=400,
            temperature=0.7 if i % 2 else 0.0,
            seed=i,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        return choice.message.parsed

    with ThreadPoolExecutor(max_workers=20) as pool:
        people = list(pool.map(parse, range(20)))
    for person in people:
        assert isinstance(person, Person)
        Person.model_validate(person.model_dump())  # every constraint, Optional included


def test_json_object(http):
    # Any object is allowed, so a 135M model may write one string until
    # max_tokens: only outputs that ended by themselves must parse, and most do.
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Give me a JSON object describing a cat."}],
        "response_format": {"type": "json_object"}, "max_tokens": 200, "temperature": 0.8, "seed": 1, "n": 4,
    })
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    finished = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert len(finished) >= 2, choices
    for content in finished:
        assert isinstance(json.loads(content), dict), content
    for c in choices:
        assert c["message"]["content"].startswith("{"), c


@pytest.mark.parametrize("pattern", [ISO_DATE, PHONE])
def test_regex_matches_in_full(http, pattern):
    prompts = ["Today's date is", "Call me at", "The meeting is on", "Her number:"]
    r = http.post("/v1/completions", json={
        "prompt": prompts, "guided_regex": pattern, "max_tokens": 32, "temperature": 0.8, "seed": 3, "n": 2,
    })
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 8
    for text in texts:
        assert re.fullmatch(pattern, text), text


def test_guided_choice(http):
    choices = ["positive", "negative", "neutral"]
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Sentiment of: I loved this film!"}],
            "guided_choice": choices, "max_tokens": 10, "stream": stream,
        })
        assert r.status_code == 200, r.text
        if stream:
            text = "".join(
                json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for line in r.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]
            )
        else:
            text = r.json()["choices"][0]["message"]["content"]
        assert text in choices


def test_lark_and_gbnf_grammars(http):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    gbnf = 'root ::= "Answer: " ("yes" | "no") "!"'
    for grammar, pattern in ((lark, r"The answer is [1-9][0-9]{0,2}\."), (gbnf, r"Answer: (yes|no)!")):
        r = http.post("/v1/completions", json={
            "prompt": "What is six times seven?", "guided_grammar": grammar, "max_tokens": 20, "temperature": 1.0,
        })
        assert r.status_code == 200, r.text
        assert re.fullmatch(pattern, r.json()["choices"][0]["text"])


def test_vllm_structured_outputs_object(http):
    # Closed, as in test_tgi_grammar_through_its_clients: an open object lets
    # a small model add keys until max_tokens.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = http.post("/v1/completions", json={
        "prompt": "Status as JSON:", "structured_outputs": {"json": schema}, "max_tokens": 30,
    })
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_tgi_grammar_through_its_clients(launcher):
    from huggingface_hub import InferenceClient
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    # Closed: with extra keys allowed, a 135M model sampling freely can add
    # keys until max_tokens, and a cut-off object does not parse.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    tgi = Client(launcher.base_url, timeout=600)
    out = tgi.generate("Largest city of Japan, as JSON:", max_new_tokens=60,
                       grammar=Grammar(type=GrammarType.Json, value=schema))
    assert out.details.finish_reason.value == "eos_token", out.details
    jsonschema.validate(json.loads(out.generated_text), schema)
    text = "".join(r.token.text for r in tgi.generate_stream(
        "Date of the moon landing:", max_new_tokens=20, grammar=Grammar(type=GrammarType.Regex, value=ISO_DATE))
        if not r.token.special)
    assert re.fullmatch(ISO_DATE, text)

    hub = InferenceClient(base_url=launcher.base_url, timeout=600)
    text = hub.text_generation("Call:", max_new_tokens=20, grammar={"type": "regex", "value": PHONE})
    assert re.fullmatch(PHONE, text)
    out = hub.chat_completion(messages=[{"role": "user", "content": "A city, as JSON."}], max_tokens=60,
                              response_format={"type": "json", "value": schema}, seed=0)
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.parametrize(("field", "value", "param"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "response_format.json_schema.schema"),
    ("guided_regex", "[a-", "guided_regex"),
    ("guided_grammar", "start: undefined_rule", "guided_grammar"),
    ("guided_json", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "guided_json"),
    ("guided_choice", [], "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(http, field, value, param):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_bad_tgi_grammar_is_rejected_before_queueing(http):
    r = http.post("/generate", json={"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(a"}}})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"
