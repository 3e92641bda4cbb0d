"""The stock baseline: MiniLM served the way a TorchServe tutorial would serve it.

A BaseHandler subclass with transformers' AutoModel/AutoTokenizer, eager fp32, mean pooling,
and TorchServe's defaults (batch size 1, one worker): one request at a time, nothing compiled,
nothing captured, no length buckets. `servekit bench` runs it as the baseline every report
compares against ("N x the stock throughput at the same SLA"). It accepts the same bodies as
servekit's handler: {"text": str | [str]}, a JSON list of strings, or a plain text body.
"""
from __future__ import annotations

import json
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer
from ts.torch_handler.base_handler import BaseHandler


class StockEmbeddingHandler(BaseHandler):
    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties.get("model_dir")
        gpu_id = context.system_properties.get("gpu_id")
        self.device = torch.device(f"cuda:{gpu_id}" if torch.cuda.is_available() and gpu_id is not None else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).to(self.device).eval()
        self.manifest = context.manifest
        self.initialized = True

    def preprocess(self, data: list[dict[str, Any]]) -> list[list[str]]:
        texts = []
        for row in data:
            body = row.get("body", row.get("data"))
            if isinstance(body, (bytes, bytearray)):
                body = body.decode("utf-8")
                try:
                    body = json.loads(body)
                except ValueError:
                    pass
            if isinstance(body, dict):
                body = body.get("text", body.get("input"))
            texts.append([body] if isinstance(body, str) else [str(t) for t in body])
        return texts

    def inference(self, data: list[list[str]], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        out = []
        for texts in data:  # one request at a time
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, p=2, dim=1))
        return out

    def postprocess(self, data: list[torch.Tensor]) -> list[str]:
        return [json.dumps({"embeddings": v.cpu().tolist()}) for v in data]
