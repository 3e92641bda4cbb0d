"""Chat prompts of realistic lengths for the LLM benchmarks: real English, every prompt a different
text, reproducible from a seed, nothing downloaded.

The text is the prose of the Python standard library's docstrings (this interpreter's own source
files, read as text: nothing is imported), paragraphs that read as sentences only (doctests,
tables and code are left out). A prompt is an instruction ("Summarise this", "Answer from the
context: ...") and a run of consecutive sentences cut at a random place. Sets:

  short         <= 60 words: an instruction about one or two sentences
  passages      450-700 prompt tokens (about 355-555 words) of context and an instruction
  mixed         20-2,000 prompt tokens, log-uniform (median about 200), the lengths of a chat service
  conversation  a multi-turn chat of about 1,500 tokens (system prompt, earlier turns, a question),
                and the user's follow-up turn sent after the model's answer

Lengths are the tokens of the messages' text (the chat template adds its own few). Given a token
counter (``count_tokens``, e.g. the served model's tokenizer), lengths are exact: a passage is cut
at the word that reaches its token target. Without one they are estimated from words (1.3 tokens
per word of this prose with SmolLM2's tokenizer; measured 1.26). The same seed, Python version and
counter give the same prompts; ``corpus_digest()`` names the text they were cut from.

    python -m servekit.benchmarks.llm_prompts --set passages --count 5            # print JSON lines
    python -m servekit.benchmarks.llm_prompts --set mixed --count 2000 --bodies > mixed.jsonl
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import math
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

SETS = ("short", "passages", "mixed", "conversation")
TOKENS_PER_WORD = 1.3
PASSAGE_TOKENS = (450, 700)
MIXED_TOKENS = (20, 2000)
SHORT_WORDS = 60
CONVERSATION_TOKENS = 1500

# Stdlib folders whose docstrings are not library prose (tests, the IDLE GUI, demos, vendored code).
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
               "__phello__", "ensurepip", "pydoc_data"}
_WORD = re.compile(r"^[A-Za-z][a-z'-]*[,.;:]?$")
_SENTENCE_END = re.compile(r"(?<=[a-z][.?!])\s+(?=[A-Z])")

SUMMARY = ("Summarise this text in three sentences.", "Summarize the following for a new colleague.",
           "Write a short summary of this documentation.", "Explain what this text describes, in plain words.",
           "List the main points of the following text.", "Rewrite this as a short paragraph for beginners.")
QUESTION = ("Answer from the context only: what does it say about {w}?",
            "Using the context below, explain the role of {w}.",
            "Read the context, then answer: when does {w} matter?",
            "From this documentation, what should a user know about {w}?")
SHORT = ("Explain this in simple words: {s}", "Rewrite this sentence more clearly: {s}",
         "Is the following statement precise? {s}", "Give an example of what this means: {s}",
         "Translate into French: {s}", "What does this sentence mean? {s}")
FOLLOWUP = ("Thanks. Can you give a short example of that?", "Which of these points matters most, and why?",
            "Could you say that again in two sentences?", "What would go wrong if I ignored this?",
            "How does that relate to the first text I sent?")
SYSTEMS = ("You are a helpful assistant who explains software documentation clearly.",
           "You are a concise technical writer. Answer accurately and briefly.",
           "You help engineers understand library documentation. Quote the text when useful.")


@dataclass(frozen=True)
class Prompt:
    """One chat request: its messages (ending with a user turn), the message tokens (counted, or
    estimated without a counter) and, for a conversation, the user's next turn."""

    set: str
    messages: tuple[dict[str, str], ...]
    tokens: int
    max_tokens: int
    followup: str | None = None

    def body(self, stream: bool = True, **extra: Any) -> dict[str, Any]:
        """The OpenAI chat-completions body: greedy, streamed with a usage chunk."""
        b: dict[str, Any] = {"messages": [dict(m) for m in self.messages], "max_tokens": self.max_tokens,
                             "temperature": 0}
        if stream:
            b.update(stream=True, stream_options={"include_usage": True})
        return {**b, **extra}

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts))


def _prose(paragraph: str) -> bool:
    """A paragraph of sentences: at least 12 words, ends with a full stop, at least 85% plain words."""
    words = paragraph.split()
    if len(words) < 12 or ">>>" in paragraph or not paragraph.endswith("."):
        return False
    return sum(1 for w in words if _WORD.match(w)) >= 0.85 * len(words)


# A triple-quoted string that opens a line: a docstring (or a multi-line constant, which the prose
# filter mostly drops). Far faster than parsing every file (ast.parse: ~20 s for the stdlib on a
# small machine, this ~1 s).
_DOCSTRING = re.compile(r'(?:^|\n)[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S)


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[tuple[str, ...], ...]:
    """The prose paragraphs of the stdlib's docstrings, each as its sentences, in file order, once each."""
    seen: set[str] = set()
    out: list[tuple[str, ...]] = []
    for path in _stdlib_files():
        for match in _DOCSTRING.finditer(path.read_text(encoding="utf-8", errors="replace")):
            for para in re.split(r"\n\s*\n", inspect.cleandoc(match.group(2))):
                para = " ".join(para.split())
                if para not in seen and _prose(para):
                    seen.add(para)
                    out.append(tuple(_SENTENCE_END.split(para)))
    if not out:
        raise RuntimeError(f"no docstring prose under {sysconfig.get_paths()['stdlib']}")
    return tuple(out)


def corpus_digest() -> str:
    """A short hash of the corpus: prompts from the same seed match where this matches."""
    h = hashlib.sha256("\n".join(" ".join(p) for p in corpus()).encode())
    return h.hexdigest()[:12]


@dataclass
class PromptGenerator:
    """Draws unique prompts of each set. `count_tokens` (text -> tokens) makes lengths exact;
    `max_seq_len` bounds prompt tokens + max_tokens (+ `template_tokens` for the chat template)."""

    seed: int = 0
    count_tokens: Callable[[str], int] | None = None
    max_seq_len: int = 2048
    template_tokens: int = 40
    _rng: np.random.Generator = field(init=False, repr=False)
    _sentences: list[str] = field(init=False, repr=False)
    _starts: list[int] = field(init=False, repr=False)
    _seen: set[str] = field(init=False, repr=False, default_factory=set)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        paras = corpus()
        self._sentences, self._starts = [], []
        for p in paras:  # a passage starts at a paragraph's first sentence and runs on across paragraphs
            self._starts.append(len(self._sentences))
            self._sentences.extend(p)
            self._sentences[-1] += "\n"

    # -- lengths ---------------------------------------------------------------------------------
    def tokens(self, text: str) -> int:
        """Tokens of `text`: counted, or estimated from its words."""
        if self.count_tokens is not None:
            return self.count_tokens(text)
        return math.ceil(len(text.split()) * TOKENS_PER_WORD)

    def _context(self, n_tokens: int, prefix: str, start: int | None = None) -> str:
        """`prefix` and consecutive corpus text from `start` (a random paragraph), cut at the word
        that brings the whole to `n_tokens` tokens."""
        i = int(self._starts[self._rng.integers(len(self._starts))]) if start is None else start
        words: list[str] = []
        budget = int(n_tokens / TOKENS_PER_WORD) + 64  # enough words whatever the counter says
        while len(words) < budget:
            words.extend(self._sentences[i % len(self._sentences)].replace("\n", " \n").split(" "))
            i += 1
        words = [w for w in words if w]

        def text(k: int) -> str:
            body = " ".join(words[:k]).replace(" \n ", "\n\n").strip()
            return f"{prefix}\n\n{body}" if prefix else body

        if self.count_tokens is None:
            k = max(1, math.floor((n_tokens - self.tokens(prefix)) / TOKENS_PER_WORD))
            return text(min(k, len(words)))
        # Words from the estimate, corrected from each count by the tokens still missing (a few
        # counts), then word by word to the first that reaches n_tokens (at most 2 more; else the
        # nearer of the cuts either side).
        k = min(len(words), max(1, math.floor((n_tokens - self.tokens(prefix)) / TOKENS_PER_WORD)))
        have = self.tokens(text(k))
        for _ in range(4):
            if abs(n_tokens - have) <= 2:
                break
            k = min(len(words), max(1, k + int((n_tokens - have) / TOKENS_PER_WORD)))
            have = self.tokens(text(k))
        while have < n_tokens and k < len(words):
            k += 1
            have = self.tokens(text(k))
        while have > n_tokens + 2 and k > 1:  # a word of several tokens overshot: one fewer
            k -= 1
            have = self.tokens(text(k))
        if have < n_tokens and k < len(words) and self.tokens(text(k + 1)) - n_tokens < n_tokens - have:
            k += 1  # a word of many tokens (a number, a name): the nearer side of the target
        return text(k)

    def _unique(self, make: Callable[[], str]) -> str:
        """A text never drawn before by this generator (its first 400 characters differ too, so no
        two prompts share a long prefix beyond the instruction)."""
        for _ in range(1000):
            t = make()
            key = t[:400]
            if key not in self._seen:
                self._seen.add(key)
                return t
        raise RuntimeError("the corpus holds too few distinct passages for this many prompts")

    def _word(self) -> str:
        """A topic word for a question: a longer plain word of a random sentence."""
        for _ in range(50):
            s = self._sentences[self._rng.integers(len(self._sentences))]
            words = [w.strip(",.;:").lower() for w in s.split() if _WORD.match(w) and len(w.strip(",.;:")) >= 7]
            if words:
                return str(words[self._rng.integers(len(words))])
        return "this module"

    def _instruction(self) -> str:
        if self._rng.random() < 0.5:
            return str(SUMMARY[self._rng.integers(len(SUMMARY))])
        return str(QUESTION[self._rng.integers(len(QUESTION))]).format(w=self._word())

    def _cap(self, prompt_tokens: int, max_tokens: int) -> int:
        return max(1, min(max_tokens, self.max_seq_len - prompt_tokens - self.template_tokens))

    # -- sets ------------------------------------------------------------------------------------
    def of_tokens(self, n_tokens: int, max_tokens: int = 256, set_name: str = "fixed") -> Prompt:
        """One prompt of `n_tokens` message tokens: an instruction and a passage."""
        text = self._unique(lambda: self._context(n_tokens, self._instruction()))
        return Prompt(set_name, ({"role": "user", "content": text},), self.tokens(text), self._cap(n_tokens, max_tokens))

    def short(self, n: int, max_tokens: int = 256) -> list[Prompt]:
        """`n` prompts of at most 60 words: an instruction about one or two sentences."""
        out = []
        for _ in range(n):
            def make() -> str:
                while True:
                    i = int(self._rng.integers(len(self._sentences)))
                    s = self._sentences[i].strip()
                    if self._rng.random() < 0.4:
                        s = f"{s} {self._sentences[(i + 1) % len(self._sentences)].strip()}"
                    t = str(SHORT[self._rng.integers(len(SHORT))]).format(s=s)
                    if len(t.split()) <= SHORT_WORDS:
                        return t
            text = self._unique(make)
            out.append(Prompt("short", ({"role": "user", "content": text},), self.tokens(text), max_tokens))
        return out

    def passages(self, n: int, max_tokens: int = 256, tokens: tuple[int, int] = PASSAGE_TOKENS) -> list[Prompt]:
        """`n` prompts of 450-700 tokens (uniform): an instruction and a passage."""
        # Targets a few tokens inside the range: a cut lands within half a word's tokens of its target.
        return [self.of_tokens(int(self._rng.integers(tokens[0] + 8, tokens[1] - 7)), max_tokens, "passages")
                for _ in range(n)]

    def mixed(self, n: int, max_tokens: tuple[int, int] = (32, 256),
              tokens: tuple[int, int] = MIXED_TOKENS) -> list[Prompt]:
        """`n` prompts of 20-2,000 tokens, log-uniform, each an instruction and a passage; max_tokens
        uniform in `max_tokens`, capped by max_seq_len."""
        hi = min(tokens[1], self.max_seq_len - self.template_tokens - max_tokens[0]) - 8
        return [self.of_tokens(int(round(math.exp(self._rng.uniform(math.log(tokens[0] + 8), math.log(hi))))),
                               int(self._rng.integers(max_tokens[0], max_tokens[1] + 1)), "mixed")
                for _ in range(n)]

    def conversation(self, n: int, tokens: int = CONVERSATION_TOKENS, max_tokens: int = 64) -> list[Prompt]:
        """`n` chats of about `tokens` tokens: a system prompt, turns of a user's passages and
        questions and the assistant's answers (other passages), a last question; `followup` is the
        user's next turn, sent after the model's answer to the last question."""
        out = []
        for _ in range(n):
            system = str(SYSTEMS[self._rng.integers(len(SYSTEMS))])
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            used = self.tokens(system)
            while True:
                turn = int(self._rng.integers(180, 320))
                answer = int(self._rng.integers(60, 160))
                if used + turn + answer > tokens - 60:
                    break
                messages.append({"role": "user", "content": self._unique(
                    lambda: self._context(turn, self._instruction()))})
                messages.append({"role": "assistant", "content": self._context(answer, "")})
                used += self.tokens(messages[-2]["content"]) + self.tokens(messages[-1]["content"])
            last = self._unique(lambda: self._context(max(20, tokens - used), self._instruction()))
            messages.append({"role": "user", "content": last})
            used += self.tokens(last)
            followup = str(FOLLOWUP[self._rng.integers(len(FOLLOWUP))])
            out.append(Prompt("conversation", tuple(messages), used, self._cap(used, max_tokens), followup))
        return out

    def take(self, set_name: str, n: int) -> list[Prompt]:
        """`n` prompts of a named set with its default max_tokens."""
        if set_name not in SETS:
            raise ValueError(f"unknown prompt set {set_name!r}; known: {', '.join(SETS)}")
        return getattr(self, set_name)(n)


def tokenizer_counter(path: str | Path) -> Callable[[str], int]:
    """Tokens of a text (no special tokens) with a tokenizer.json or a model folder's."""
    from tokenizers import Tokenizer

    path = Path(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def chat_bodies(prompts: Iterable[Prompt], **extra: Any) -> list[str]:
    """Each prompt as a streamed chat body, serialised (a sweep's payload lines)."""
    return [json.dumps(p.body(**extra), ensure_ascii=False) for p in prompts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=SETS, required=True)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json or a model folder: exact token lengths")
    p.add_argument("--bodies", action="store_true", help="print streamed chat bodies (one JSON per line)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    gen = PromptGenerator(args.seed, tokenizer_counter(args.tokenizer) if args.tokenizer else None)
    for prompt in gen.take(args.set, args.count):
        line = prompt.body() if args.bodies else {"set": prompt.set, "tokens": prompt.tokens,
                                                  "max_tokens": prompt.max_tokens, "messages": prompt.messages,
                                                  "followup": prompt.followup}
        print(json.dumps(line, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
