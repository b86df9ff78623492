"""Workloads: the requests a benchmark sends, built before the clock starts.

A workload is a *plan*: a list of sessions, each a list of turns. A session is
what occupies one concurrency slot; `random` and `shared-prefix` sessions have
one turn, a `multi-turn` session is a conversation whose turns run one after the
other, each re-sending the whole history so far.

Token counts are exact for the tokenizer the counter stands for. A prompt of N
tokens means N as the server counts the `prompt` of a /v1/completions request,
special tokens it adds (BOS) included, so `usage.prompt_tokens` must equal N; the
runner checks that and reports every mismatch. Chat requests add a template the
client cannot see, so there only the message contents are sized.

Prompts are made of common English words, each preceded by a space. Every
tokenizer we know splits before a space, so a word never merges with its
neighbour and a prompt's count is the sum of its words' costs; `exact_text`
fills the budget with that and verifies the final count.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

# Common words: in real tokenizers each is one token with its leading space (all
# 398 are, in SmolLM2's), so prompts read as text and sizing them is cheap.
WORDS = list(dict.fromkeys("""
the of and to in is was for that with as on by at from his her they this which
have are be or had not but one all were when we there can an your more their has
been would will other into if time so some these two may first then do any like
my now over such our man me even most made after also did many before must
through back years where much way well down should because each just those
people how too little state good very make world still own see men work long
get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three
place small home part high large every found still side show house water room
city light head read open hand point air kind need line book tree land study
plant food sun four keep eye never last door city cross farm hard start
story saw far sea draw left late run tell river car feet care second group carry
took rain eat room friend began idea fish north once base hold horse cut sure
watch color face wood main enough plain girl usual young ready above ever red
list though feel talk bird soon body dog family direct pose leave song measure
state product black short class wind question happen complete ship area half
rock order fire south problem piece told knew pass farm top whole king size heard
best hour better true during hundred am remember step early west ground interest
reach fast five sing listen six table travel less morning ten simple several
vowel toward war lay against pattern slow center love person money serve appear
road map science rule govern pull cold notice voice fall power town fine certain
fly unit lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave
green oh quick develop sleep warm free minute strong special mind behind clear
tail produce fact street inch lot nothing course stay wheel full force blue
object decide surface deep moon island foot yet busy test record boat common gold
possible plane age dry wonder laugh thousand ago ran check game shape yes hot miss
brought heat snow bed bring sit perhaps fill east weight language among
""".split()))


class TokenCounter(Protocol):
    """Counts the tokens of a completion prompt as the served model's tokenizer
    does, special tokens the server adds included."""

    async def count(self, text: str) -> int: ...

    def describe(self) -> str: ...


class LocalTokenizer:
    """A tokenizer on this machine: a `tokenizers` tokenizer.json, a folder that
    holds one (or, failing that, anything transformers' AutoTokenizer reads from
    disk), or a .gguf file (through transformers)."""

    def __init__(self, tokenizer, source: str):
        self._tok = tokenizer
        self._source = source

    @classmethod
    def load(cls, path: str | Path) -> "LocalTokenizer":
        path = Path(path)
        if path.suffix == ".gguf" and path.is_file():
            # What llama.cpp serves: the tokenizer lives in the file's metadata.
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                return cls(tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok, str(path))
            except Exception as e:
                raise ValueError(f"cannot read the tokenizer of {path}: {e}") from None
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            try:
                return cls(Tokenizer.from_file(str(path)), str(path))
            except Exception as e:  # a corrupt or foreign file
                raise ValueError(f"cannot read tokenizer file {path}: {e}") from None
        if path.is_dir():
            try:
                from transformers import AutoTokenizer

                return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), str(path))
            except Exception as e:
                raise ValueError(f"cannot load a tokenizer from folder {path}: {e}") from None
        raise ValueError(f"tokenizer path {path} does not exist")

    async def count(self, text: str) -> int:
        # Both `tokenizers.Tokenizer` and transformers tokenizers accept this call;
        # add_special_tokens=True mirrors what servers do with a completion prompt.
        enc = self._tok.encode(text, add_special_tokens=True)
        return len(enc.ids) if hasattr(enc, "ids") else len(enc)

    def describe(self) -> str:
        return f"local:{self._source}"


class RemoteTokenizer:
    """The server's own tokenizer through `POST /tokenize`, in whichever of the
    dialects we know the server speaks (tried in order, the first that answers
    200 is kept):

      TGI / Sluice: {"inputs": text}                         -> [{"id":..,"text":..}, ...]
      vLLM:         {"model":.., "prompt": text, ...}        -> {"count": n, "tokens": [...]}
      llama.cpp:    {"content": text, "add_special": true}   -> {"tokens": [...]}
    """

    def __init__(self, client: httpx.AsyncClient, root_url: str, model: str | None, headers: dict):
        self._client = client
        self._url = root_url.rstrip("/") + "/tokenize"
        self._model = model
        self._headers = headers
        self._dialect: int | None = None
        self._empty: int | None = None

    def _bodies(self, text: str) -> list[dict]:
        vllm = {"prompt": text, "add_special_tokens": True}
        if self._model:
            vllm["model"] = self._model
        return [{"inputs": text}, vllm, {"content": text, "add_special": True}]

    async def count(self, text: str) -> int:
        if not text:
            return await self._count_empty()
        return await self._count(text)

    async def _count_empty(self) -> int:
        """Tokens of an empty prompt (the special tokens alone). Servers refuse
        to tokenize "" (Sluice and TGI answer 422), so it is derived: a word
        repeated is one more word, ` the` = E + w and ` the the` = E + 2w, hence
        E = 2 * count(" the") - count(" the the")."""
        if self._empty is None:
            self._empty = 2 * await self._count(" the") - await self._count(" the the")
        return self._empty

    async def _count(self, text: str) -> int:
        bodies = self._bodies(text)
        tries = [self._dialect] if self._dialect is not None else range(len(bodies))
        answers = []
        for i in tries:
            resp = await self._client.post(self._url, json=bodies[i], headers=self._headers)
            if resp.status_code == 200:
                self._dialect = i
                return parse_tokenize_response(resp.json())
            answers.append(f"{resp.status_code}: {resp.text[:120]}")
        raise ValueError(f"POST {self._url} answered {'; '.join(answers)}")

    def describe(self) -> str:
        return f"server:{self._url}"


def parse_tokenize_response(data) -> int:
    if isinstance(data, list):
        return len(data)
    if isinstance(data, dict):
        if isinstance(data.get("count"), int):
            return data["count"]
        if isinstance(data.get("tokens"), list):
            return len(data["tokens"])
    raise ValueError(f"unrecognised /tokenize answer: {str(data)[:200]}")


def render(words: list[str]) -> str:
    return "".join(" " + w for w in words)


class WordCosts:
    """Tokens each word adds to a prompt, learned from the counter once per word.

    Words are space-separated, and tokenizers split before a space, so a
    prompt's count is its fixed part plus the sum of its words' costs; the
    final count is still verified, never assumed."""

    def __init__(self, counter: TokenCounter):
        self.counter = counter
        self._empty: int | None = None
        self._cost: dict[str, int] = {}

    async def cost(self, word: str) -> int:
        if self._empty is None:
            self._empty = await self.counter.count("")
        if word not in self._cost:
            self._cost[word] = await self.counter.count(render([word])) - self._empty
        return self._cost[word]

    async def fitting(self, budget: int) -> list[str]:
        """All words that cost at most `budget` tokens, in WORDS order."""
        return [w for w in WORDS if 0 < await self.cost(w) <= budget]


async def exact_text(counter: TokenCounter, target: int, rng: random.Random, prefix: str = "",
                     costs: WordCosts | None = None) -> str:
    """Returns `suffix` such that count(prefix + suffix) == target.

    Draws random words while they fit the remaining budget; near the end, when
    random draws stop fitting, it picks among the words that do (the cheapest
    word of a real tokenizer is one token, so every budget can be met). Then
    it counts the whole text; should the tokenizer merge across a boundary
    after all, a few rounds of drop-and-redraw correct the count.
    """
    costs = costs or WordCosts(counter)
    floor = await counter.count(prefix)
    if target < floor:
        raise ValueError(f"cannot build a prompt of {target} tokens: the fixed part alone has {floor}")
    words: list[str] = []
    for _ in range(20):
        n = await counter.count(prefix + render(words))
        if n == target:
            return render(words)
        if n > target:
            del words[-max(1, min(n - target, len(words))):]
            continue
        await _fill(words, target - n, rng, costs)
    raise ValueError(f"could not reach exactly {target} tokens with {counter.describe()}")


async def _fill(words: list[str], budget: int, rng: random.Random, costs: WordCosts) -> None:
    """Appends words whose costs sum to `budget`."""
    while budget > 0:
        for _ in range(8):
            w = rng.choice(WORDS)
            c = await costs.cost(w)
            if 0 < c <= budget:
                break
        else:
            fit = await costs.fitting(budget)
            if not fit:
                raise ValueError(f"no word of at most {budget} tokens with {costs.counter.describe()}")
            w = rng.choice(fit)
            c = await costs.cost(w)
        words.append(w)
        budget -= c


# ---------------------------------------------------------------------------
# The plan


@dataclass
class Turn:
    """One request. `prompt` for /v1/completions; `system` and `user` for chat
    (the runner prepends the conversation's history)."""

    prompt: str
    system: str | None
    user: str
    max_tokens: int
    # What usage.prompt_tokens must be (completions only; None where a chat
    # template makes it unknowable).
    expected_prompt_tokens: int | None


@dataclass
class Session:
    index: int
    turns: list[Turn]
    group: int = 0


@dataclass
class WorkloadSpec:
    kind: str = "random"  # random | shared-prefix | multi-turn
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    num_groups: int = 1
    prompts_per_group: int = 32
    system_prompt_len: int = 1024
    question_len: int = 32
    num_conversations: int = 8
    num_turns: int = 4

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name in ("output_len",) + KINDS[self.kind]:
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")

    def num_requests(self) -> int:
        if self.kind == "random":
            return self.num_prompts
        if self.kind == "shared-prefix":
            return self.num_groups * self.prompts_per_group
        return self.num_conversations * self.num_turns

    def describe(self) -> str:
        if self.kind == "random":
            return f"random {self.num_prompts} x {self.input_len} in / {self.output_len} out"
        if self.kind == "shared-prefix":
            return (f"shared-prefix {self.num_groups} groups x {self.prompts_per_group} prompts, "
                    f"system {self.system_prompt_len} + question {self.question_len} in / {self.output_len} out")
        return (f"multi-turn {self.num_conversations} conversations x {self.num_turns} turns, "
                f"{self.input_len} in per turn / {self.output_len} out")


# The size fields each workload reads (all must be >= 1).
KINDS = {
    "random": ("num_prompts", "input_len"),
    "shared-prefix": ("num_groups", "prompts_per_group", "system_prompt_len", "question_len"),
    "multi-turn": ("num_conversations", "num_turns", "input_len"),
}


@dataclass
class Plan:
    spec: WorkloadSpec
    seed: int
    sessions: list[Session] = field(default_factory=list)
    tokenizer: str = ""

    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


async def build_plan(spec: WorkloadSpec, counter: TokenCounter, seed: int, chat: bool = False) -> Plan:
    """The same (spec, tokenizer, seed) always gives the same plan."""
    spec.validate()
    rng = random.Random(seed)
    costs = WordCosts(counter)
    plan = Plan(spec=spec, seed=seed, tokenizer=counter.describe())
    if spec.kind == "random":
        for i in range(spec.num_prompts):
            text = await exact_text(counter, spec.input_len, rng, costs=costs)
            plan.sessions.append(Session(i, [_turn(None, text, spec, spec.input_len, chat)]))
    elif spec.kind == "shared-prefix":
        for g in range(spec.num_groups):
            system = await exact_text(counter, spec.system_prompt_len, rng, costs=costs)
            total = spec.system_prompt_len + spec.question_len
            for _ in range(spec.prompts_per_group):
                question = await exact_text(counter, total, rng, prefix=system, costs=costs)
                index = len(plan.sessions)
                plan.sessions.append(Session(index, [_turn(system, question, spec, total, chat)], group=g))
    else:
        for c in range(spec.num_conversations):
            turns = []
            for _ in range(spec.num_turns):
                text = await exact_text(counter, spec.input_len, rng, costs=costs)
                turns.append(Turn(prompt=text, system=None, user=text, max_tokens=spec.output_len,
                                  expected_prompt_tokens=None))
            plan.sessions.append(Session(c, turns))
    return plan


def _turn(system: str | None, user: str, spec: WorkloadSpec, expected: int, chat: bool) -> Turn:
    return Turn(
        prompt=(system or "") + user,
        system=system,
        user=user,
        max_tokens=spec.output_len,
        expected_prompt_tokens=None if chat else expected,
    )


def build_plan_sync(spec: WorkloadSpec, counter: TokenCounter, seed: int, chat: bool = False) -> Plan:
    return asyncio.run(build_plan(spec, counter, seed, chat))
