"""SmolLM2-135M-Instruct real weights: GGUF conversion, and parity with transformers (fp32, CPU).

The reference is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``), so our
dequantization and q/k un-permutation are checked against an independent implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.gguf_weights import find_smollm2_gguf, smollm2_archive_files
from servekit.optimizations.models.llama import Transformer, load_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "Write a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning' into Spanish and explain its usage.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe the water cycle in a few sentences.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet.",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def converted() -> Path:
    # convert_gguf_to_safetensors, cached in ~/.cache/servekit while the GGUF is unchanged.
    return smollm2_archive_files(torch.float32)[0].parent


@pytest.fixture(scope="module")
def tokenizer(converted: Path):
    return transformers.AutoTokenizer.from_pretrained(str(converted))


@pytest.fixture(scope="module")
def ours(converted: Path) -> Transformer:
    return load_llama(converted, "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference():
    gguf = find_smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


def _chat_ids(tokenizer, text: str) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_converted_folder_is_a_complete_hf_checkpoint(converted: Path, tokenizer) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 3
    # Chat template and special tokens survive the round trip (ids as llama.cpp's vocabulary has them).
    assert _chat_ids(tokenizer, "hi") == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308,
                                          34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 6004,
                                          2, 198, 1, 520, 9531, 198]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_logits_match_transformers(ours: Transformer, reference, tokenizer) -> None:
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS[:3]]
    longest = max(map(len, prompts))
    ours.setup_caches(16, 128)
    batch = torch.zeros(len(prompts), longest, dtype=torch.int64)  # right-padded batch, per-row positions
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = torch.tensor(p)
    with torch.no_grad():
        got = ours(batch, torch.arange(longest).expand(len(prompts), longest))
        for i, p in enumerate(prompts):
            ref = reference(torch.tensor([p])).logits[0]
            torch.testing.assert_close(got[i, :len(p)], ref, atol=2e-3, rtol=1e-4)


def test_greedy_tokens_match_transformers(ours: Transformer, reference, tokenizer) -> None:
    """First 32 greedy tokens of 12 chat prompts, generated as one batch on both sides.

    Stop tokens are off on both sides, so every row yields 32 tokens (greedy continues past
    <|im_end|> deterministically).
    """
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS]
    runner = LlamaRunner(ours, max_seq_len=128, batch_buckets=(16,), prefill_buckets=(64,))
    got = [c.tokens for c in generate(runner, prompts, [SamplingParams(max_tokens=32)] * len(prompts))]

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # transformers batches with left padding
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    config = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, pad_token_id=2, eos_token_id=None)
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        want = reference.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    assert all(len(t) == 32 for t in want)
    assert got == want


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Ünïcödé ✓ 你好 🚀"}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_tokenizer_matches_transformers_chat_template(converted: Path, tokenizer, messages) -> None:
    from servekit.optimizations.llm.chat_template import ChatTokenizer

    ours = ChatTokenizer(converted)
    assert ours.encode_chat(messages) == _chat_ids_of(tokenizer, messages)
    assert ours.render(messages) == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == 2


def _chat_ids_of(tokenizer, messages) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_incremental_detokenizer_streams_whole_characters_and_honours_stop_strings(converted: Path) -> None:
    from servekit.optimizations.llm.chat_template import ChatTokenizer, IncrementalDetokenizer

    tok = ChatTokenizer(converted)
    text = "Ünïcödé ✓ 你好 🚀 and the end. STOP here, never this."
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids] + [det.finish()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # streamed piece by piece, not all at the end
    det = IncrementalDetokenizer(tok, stop=["STOP", "zzz"])
    out = ""
    for i in ids:
        out += det.push(i)
        if det.stopped:
            break
    out += det.finish()
    assert out == "Ünïcödé ✓ 你好 🚀 and the end. " and det.stopped
    # vLLM's include_stop_str_in_output: the text ends with the stop string; of two that start at
    # the same place, the longer
    det = IncrementalDetokenizer(tok, stop=["zzz", "STO", "STOP"], include_stop=True)
    out = "".join(det.push(i) for i in ids) + det.finish()
    assert out == "Ünïcödé ✓ 你好 🚀 and the end. STOP" and det.stopped
    # Special tokens (the chat markers) never reach the text.
    det = IncrementalDetokenizer(tok)
    assert "".join(det.push(i) for i in tok.encode("<|im_start|>assistant\nHi<|im_end|>")) + det.finish() == "assistant\nHi"


def test_token_bytes_spell_the_text_whatever_the_decoder_wrapping(converted: Path) -> None:
    """Logprobs' `bytes`: a token's own bytes (part of a UTF-8 character included), for the
    tokenizer as saved and with its ByteLevel decoder wrapped in a Sequence (as other transformers
    versions save it)."""
    from tokenizers import decoders

    from servekit.optimizations.llm.chat_template import ChatTokenizer, is_byte_level

    text = "Rhône, 日本語 ✓ and <|im_end|>"
    for wrap in (False, True):
        tok = ChatTokenizer(converted)
        if wrap:
            tok.tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
            tok.byte_level = is_byte_level(tok.tokenizer)
        assert tok.byte_level
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
        assert any("\ufffd" in tok.token_text(i) for i in ids)  # a token holding part of a character


def test_chat_ids_by_cached_pieces_equal_the_whole_texts_ids(converted: Path) -> None:
    """Byte-level tokenizers encode a rendered chat piece by piece between its special tokens, with
    a cache per piece: the ids equal the library's for the whole text, hit or miss; an added token
    that strips whitespace (its piece's ids depend on its neighbours) turns the pieces off."""
    from tokenizers import AddedToken, Tokenizer

    from servekit.optimizations.llm.chat_template import ChatTokenizer, PieceCache

    tok = ChatTokenizer(converted)
    whole = lambda text: tok.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello  there\n\n"},
             {"role": "assistant", "content": " Hi!<|im_end|>"}, {"role": "user", "content": "Ünïcödé ✓ 你好 🚀 "}]
    texts = [tok.render(turns[:k]) for k in range(1, len(turns) + 1)] * 2  # the second round hits the cache
    texts += ["", "<|im_start|>", "<|im_start|><|im_end|>\n<|endoftext|>", "  <|im_end|>  x<|im_start|>user\n"]
    assert tok._pieces is not None and tok._pieces.split is not None
    for text in texts:
        assert tok.encode(text) == whole(text), text
    assert 0 < len(tok._pieces.cache) <= tok._pieces.size
    small = PieceCache(tok.tokenizer, size=2)
    for text in texts:
        assert small.encode(text) == whole(text)
    assert len(small.cache) == 2
    # Texts tokenized together (one batch call for the pieces none had cached): each text's own ids,
    # with pieces repeated across texts, some cached and some not, and more pieces than the cache holds.
    small.cache.clear()
    small.encode(texts[1])
    assert small.encode_batch(texts) == [whole(text) for text in texts] and len(small.cache) == 2
    assert tok.encode_batch(texts[::-1]) == [whole(text) for text in texts[::-1]]
    plain = ["The sea", "", "x y"]
    assert tok.encode_prompts(plain) == [tok.tokenizer.encode(t, add_special_tokens=True).ids for t in plain]
    stripping = Tokenizer.from_str(tok.tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<|sep|>", rstrip=True)])
    assert PieceCache(stripping).split is None
    assert PieceCache(stripping).encode("a <|sep|>  b") == stripping.encode("a <|sep|>  b", add_special_tokens=False).ids


def test_incremental_detokenizer_streams_a_sentencepiece_style_tokenizer(tmp_path: Path) -> None:
    """Llama 2 / Gemma-style tokenizers: a leading-space marker and <0xNN> byte tokens for what the
    vocabulary lacks. Streamed text equals the library's decode of all ids, whole characters only."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from servekit.optimizations.llm.chat_template import ChatTokenizer, IncrementalDetokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list("abcdefghijklmnopqrstuvwxyzHST.,")
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ messages }}"}))
    chat = ChatTokenizer(tmp_path)
    text = "Hello wörld, 你好 🚀 the end. STOP"
    ids = chat.encode(text)
    assert any(pieces[i].startswith("<0x") for i in ids)  # characters spelled in byte tokens
    det = IncrementalDetokenizer(chat)
    streamed = [det.push(i) for i in ids] + [det.finish()]
    assert "".join(streamed) == chat.decode(ids) == text and all("\ufffd" not in p for p in streamed)
    det = IncrementalDetokenizer(chat, stop=["STOP"])
    assert "".join(det.push(i) for i in ids + chat.encode(" never")) + det.finish() == "Hello wörld, 你好 🚀 the end. "
