"""What a sentence-embedding model computes, read from its own files (as Hugging Face TEI does).

A sentence-transformers folder says it in `modules.json` (Transformer -> Pooling -> Dense ... ->
Normalize), `<pooling>/config.json` (the modes), `<dense>/config.json` + weights,
`sentence_bert_config.json` (max_seq_length, do_lower_case), the tokenizer's `model_max_length`
(newer sentence-transformers keep the limit there) and `config_sentence_transformers.json`
(prompts). A plain Hugging Face encoder without these files is mean-pooled and not normalised, as
sentence-transformers itself does with one.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from servekit.optimizations.models.encoder import UnsupportedModel

log = logging.getLogger(__name__)

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older pooling config: one boolean per mode (concatenated in this order).
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
DENSE_ACTIVATIONS = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity",
                     "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.GELU",
                     "torch.nn.modules.activation.Sigmoid")
# A tokenizer's model_max_length above this is transformers' "no limit" placeholder (1e30).
_NO_LIMIT = 1_000_000


@dataclass(frozen=True)
class DenseSpec:
    path: str  # folder inside the model directory holding config.json and model.safetensors
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "torch.nn.modules.activation.Tanh"


@dataclass(frozen=True)
class SentenceModel:
    transformer_path: str = ""                 # folder of config.json, weights and tokenizer
    pooling: tuple[str, ...] = ("mean",)
    head: tuple[DenseSpec | str, ...] = ()     # after pooling, in order: DenseSpec or "normalize"
    max_seq_length: int | None = None          # None: the position table's length
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    described: bool = True                     # False: a plain encoder, defaults assumed

    @property
    def normalized(self) -> bool:
        """Whether the output is L2-normalised (a Normalize module last)."""
        return bool(self.head) and self.head[-1] == "normalize"


def _json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing") from None
    except ValueError as e:
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, (dict, list)):
        raise UnsupportedModel(f"{path}: expected a JSON object")
    return raw


def pooling_modes(cfg: dict, where: Path) -> tuple[str, ...]:
    """The pooling modes of a sentence-transformers Pooling config, old or new format."""
    if "pooling_mode" in cfg:
        raw = cfg["pooling_mode"]
        modes = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, list) else None
        if not modes:
            raise UnsupportedModel(f"{where}: pooling_mode must be a mode name or a list of them, got {raw!r}")
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key)) or ("mean",)
        unknown_keys = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode_") and k not in _LEGACY_POOLING_KEYS and v)
        if unknown_keys:
            raise UnsupportedModel(f"{where}: pooling mode {unknown_keys[0]!r} is not supported; "
                                   f"supported: {', '.join(POOLING_MODES)}")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise UnsupportedModel(f"{where}: pooling mode {mode!r} is not supported; supported: {', '.join(POOLING_MODES)}")
    return modes


def _dense(model_dir: Path, path: str) -> DenseSpec:
    where = model_dir / path / "config.json"
    cfg = _json(where)
    activation = cfg.get("activation_function", DenseSpec.activation)
    if activation not in DENSE_ACTIVATIONS:
        raise UnsupportedModel(f"{where}: Dense activation {activation!r} is not supported; supported: "
                               f"{', '.join(a.rsplit('.', 1)[1] for a in DENSE_ACTIVATIONS)}")
    if not (model_dir / path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{model_dir / path / 'model.safetensors'}: Dense weights missing (pickled weights "
                                "are never loaded)")
    try:
        return DenseSpec(path, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)), activation)
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModel(f"{where}: in_features and out_features must be integers ({type(e).__name__}: {e})") from None


def _max_seq_length(model_dir: Path, transformer_path: str) -> tuple[int | None, bool]:
    base = model_dir / transformer_path
    sbert = base / "sentence_bert_config.json"
    raw = _json(sbert) if sbert.is_file() else {}
    lower = bool(raw.get("do_lower_case", False))
    if isinstance(raw.get("max_seq_length"), int):
        return raw["max_seq_length"], lower
    tok = base / "tokenizer_config.json"
    limit = _json(tok).get("model_max_length") if tok.is_file() else None
    if isinstance(limit, (int, float)) and 0 < limit < _NO_LIMIT:
        return int(limit), lower
    return None, lower


def read_sentence_model(model_dir: Path) -> SentenceModel:
    """The embedding pipeline of `model_dir`. UnsupportedModel or FileNotFoundError name what is wrong."""
    model_dir = Path(model_dir)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        max_len, lower = _max_seq_length(model_dir, "")
        log.warning("%s has no modules.json: mean pooling over the attention mask, no normalisation "
                    "(what sentence-transformers does with a plain Hugging Face encoder)", model_dir)
        return SentenceModel(max_seq_length=max_len, do_lower_case=lower, described=False)
    modules = _json(modules_file)
    if not isinstance(modules, list) or not modules:
        raise UnsupportedModel(f"{modules_file}: expected a non-empty list of modules")
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    if kinds[0][0] != "Transformer":
        raise UnsupportedModel(f"{modules_file}: the first module must be a Transformer, got {kinds[0][0]!r}")
    transformer_path = kinds[0][1]
    pooling: tuple[str, ...] | None = None
    head: list[DenseSpec | str] = []
    include_prompt_false: Path | None = None
    for kind, path in kinds[1:]:
        if kind == "Pooling" and pooling is None and not head:
            where = model_dir / path / "config.json"
            cfg = _json(where)
            pooling = pooling_modes(cfg, where)
            if cfg.get("include_prompt", True) is False:
                include_prompt_false = where
        elif kind == "Dense" and pooling is not None:
            head.append(_dense(model_dir, path))
        elif kind == "Normalize" and pooling is not None:
            head.append("normalize")
        else:
            raise UnsupportedModel(f"{modules_file}: module {kind!r} (path {path!r}) is not supported here; "
                                   "supported: Transformer, then Pooling, then Dense / Normalize")
    if pooling is None:
        raise UnsupportedModel(f"{modules_file}: no Pooling module")
    max_len, lower = _max_seq_length(model_dir, transformer_path)
    st_cfg = model_dir / "config_sentence_transformers.json"
    st = _json(st_cfg) if st_cfg.is_file() else {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise UnsupportedModel(f"{st_cfg}: prompts must map names to strings")
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedModel(f"{st_cfg}: default_prompt_name {default!r} is not one of the prompts")
    if include_prompt_false is not None and any(prompts.values()):
        raise UnsupportedModel(f"{include_prompt_false}: include_prompt: false (prompt tokens left out of pooling) "
                               "is not supported for a model with prompts")
    return SentenceModel(transformer_path, pooling, tuple(head), max_len, lower, dict(prompts), default)
