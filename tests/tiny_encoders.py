"""Tiny random encoders saved the way users' models are: transformers' `save_pretrained` for the
model and tokenizer, sentence-transformers' own `save()` for the pipeline around it."""
from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("the a cat dog sat on mat ran fast slow big small red blue hello world query passage what is "
         "how many people live in paris london berlin river ocean mountain book music city").split()
SHORT = ["the cat sat on the mat", "hello world", "what is the river", "a"]
# Longer than the small buckets the tests serve (and than sentence-transformers' limit in some models).
LONG = ["the big red dog ran fast on the mat " * 6, "how many people live in paris " * 9]
TEXTS = SHORT + LONG


def tokenizer(family: str):
    """A word-level WordPiece tokenizer with the family's special tokens ([CLS]/[SEP] or <s>/</s>)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family in ("bert", "distilbert", "modernbert"):
        specials = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}
        order = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    else:  # RoBERTa, XLM-R, MPNet: <s> = 0, <pad> = 1 (the padding_idx their positions start after)
        specials = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                    "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>"}
        order = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(order + list(WORDS))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = specials["cls_token"], specials["sep_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
                                                       special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials), len(vocab)


def hf_encoder(path: Path, family: str, seed: int = 0, max_positions: int = 80) -> Path:
    """A random tiny Hugging Face encoder of `family` (bert, roberta, xlm-roberta, distilbert, mpnet, modernbert)."""
    from transformers import (BertConfig, BertModel, DistilBertConfig, DistilBertModel, ModernBertConfig,
                              ModernBertModel, MPNetConfig, MPNetModel, RobertaConfig, RobertaModel, XLMRobertaConfig,
                              XLMRobertaModel)

    tok, vocab = tokenizer(family)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    offset = 0 if family == "bert" else 2  # padding_idx + 1
    torch.manual_seed(seed)
    if family == "bert":
        model = BertModel(BertConfig(**common, max_position_embeddings=max_positions))
    elif family == "roberta":
        model = RobertaModel(RobertaConfig(**common, max_position_embeddings=max_positions + offset, pad_token_id=1))
    elif family == "xlm-roberta":
        model = XLMRobertaModel(XLMRobertaConfig(**common, max_position_embeddings=max_positions + offset, pad_token_id=1))
    elif family == "mpnet":
        model = MPNetModel(MPNetConfig(**common, max_position_embeddings=max_positions + offset, pad_token_id=1))
    elif family == "distilbert":
        model = DistilBertModel(DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                                 max_position_embeddings=max_positions))
    elif family == "modernbert":
        # Four layers: global, local, local, global. A window of 8 (4 keys either side) is shorter
        # than most test texts, so the local layers really cut attention; biases on to cover them.
        model = ModernBertModel(ModernBertConfig(
            **{**common, "num_hidden_layers": 4}, max_position_embeddings=max_positions, global_attn_every_n_layers=3,
            local_attention=8, global_rope_theta=160000.0, local_rope_theta=10000.0, norm_bias=True,
            attention_bias=True, mlp_bias=True, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
            eos_token_id=3))
    else:
        raise ValueError(family)
    # Random init leaves LayerNorms at 1/0 and biases at 0: perturb every tensor so that each one matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def st_model(path: Path, family: str, pooling: str | tuple[str, ...] = "mean", dense: int | None = None,
             normalize: bool = True, max_seq_length: int | None = 24, prompts: dict[str, str] | None = None,
             default_prompt_name: str | None = None, seed: int = 0, max_positions: int = 80) -> Path:
    """A sentence-transformers folder around a tiny `family` encoder, saved with its own `save()`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as stm

    hf = hf_encoder(path.parent / f"{path.name}-hf", family, seed, max_positions)
    modules = [stm.Transformer(str(hf), max_seq_length=max_seq_length)]
    modules.append(stm.Pooling(32, pooling_mode=pooling))
    width = modules[-1].get_embedding_dimension()
    if dense:
        torch.manual_seed(seed + 1)
        modules.append(stm.Dense(width, dense))
    if normalize:
        modules.append(stm.Normalize())
    st = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name, device="cpu")
    st.save(str(path))
    return path


def reference(path: Path, texts: list[str], **kw) -> torch.Tensor:
    """sentence-transformers' embeddings of `texts` (fp32, CPU)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), device="cpu")
    return st.encode(texts, convert_to_tensor=True, **kw).float()


# A tiny nomic-embed-text-shaped config (NomicBertConfig's fields as its published config.json
# writes them): no config class for it exists outside the model's own remote code, so it is written here.
NOMIC_CONFIG = dict(model_type="nomic_bert", architectures=["NomicBertModel"], n_embd=32, n_head=4, n_layer=2,
                    n_inner=48, n_positions=80, layer_norm_epsilon=1e-12, activation_function="swiglu",
                    rotary_emb_fraction=1.0, rotary_emb_base=1000, rotary_emb_interleaved=False,
                    rotary_emb_scale_base=None, rotary_scaling_factor=None, max_trained_positions=2048,
                    qkv_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, causal=False,
                    use_rms_norm=False, parallel_block=False, type_vocab_size=2, pad_vocab_size_multiple=8,
                    pad_token_id=0)


def nomic_weights(cfg: dict, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under NomicBertModel's names, shaped as its published code builds them (the
    gated MLP's width rounded up to 256, the vocabulary up to pad_vocab_size_multiple)."""
    g = torch.Generator().manual_seed(seed)
    h, inner = cfg["n_embd"], (cfg["n_inner"] + 255) // 256 * 256
    vocab += -vocab % cfg["pad_vocab_size_multiple"]

    def rnd(*shape: int, around: float = 0.0) -> torch.Tensor:
        return around + torch.randn(*shape, generator=g) * (0.3 if around == 0.0 else 0.05)

    w = {"embeddings.word_embeddings.weight": rnd(vocab, h), "embeddings.token_type_embeddings.weight": rnd(2, h),
         "emb_ln.weight": rnd(h, around=1.0), "emb_ln.bias": rnd(h)}
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        w |= {p + "attn.Wqkv.weight": rnd(3 * h, h), p + "attn.out_proj.weight": rnd(h, h),
              p + "mlp.fc11.weight": rnd(inner, h), p + "mlp.fc12.weight": rnd(inner, h),
              p + "mlp.fc2.weight": rnd(h, inner) / 4, p + "norm1.weight": rnd(h, around=1.0),
              p + "norm1.bias": rnd(h), p + "norm2.weight": rnd(h, around=1.0), p + "norm2.bias": rnd(h)}
        if cfg["qkv_proj_bias"]:
            w |= {p + "attn.Wqkv.bias": rnd(3 * h), p + "attn.out_proj.bias": rnd(h)}
        if cfg["mlp_fc1_bias"]:
            w |= {p + "mlp.fc11.bias": rnd(inner), p + "mlp.fc12.bias": rnd(inner)}
        if cfg["mlp_fc2_bias"]:
            w |= {p + "mlp.fc2.bias": rnd(h)}
    return w


def nomic_st_model(path: Path, prompts: dict[str, str] | None = None, seed: int = 0, **overrides) -> Path:
    """A nomic-embed-text-shaped sentence-transformers folder (mean pooling, normalised, its modules
    saved by sentence-transformers' own `save()`), whose Transformer is a tiny NomicBertModel."""
    import json

    from safetensors.torch import save_file

    st_model(path, "bert", "mean", prompts=prompts, seed=seed)
    _, vocab = tokenizer("bert")
    cfg = {**NOMIC_CONFIG, "vocab_size": vocab, **overrides}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(nomic_weights(cfg, vocab, seed), str(path / "model.safetensors"))
    return path
