"""Information density of tokens and chunks (LLMS §3.2, Eq. 1).

Plain numpy; this module deliberately knows nothing about the model beyond its head and layer counts.

A token's density is the attention it receives, averaged over the rows that can see it (itself and
every later row), over heads and over layers. The engine adds each prefill or decode pass's column sums
of the attention matrix (already summed over heads and layers) with `add`; recompute never does, so
restoring a chunk leaves densities as they were. A chunk's density is the mean over its tokens.
"""

from __future__ import annotations

import numpy as np


class DensityTracker:
    def __init__(self, n_heads: int, n_layers: int) -> None:
        self.norm = float(n_heads * n_layers)
        self.sums = np.zeros(0, dtype=np.float64)
        """Per token: attention received, summed over heads, layers and rows."""
        self.rows = np.zeros(0, dtype=np.int64)
        """Per token: rows that have attended to it (itself and later rows)."""

    def __len__(self) -> int:
        return len(self.sums)

    def add(self, start: int, n_rows: int, col_sums) -> None:
        """Record a pass of `n_rows` rows at positions `start..start+n_rows-1` with `col_sums[j]`, the
        attention key `j` received from those rows, summed over heads and layers."""
        total = start + n_rows
        if start != len(self.sums):
            raise RuntimeError(f"density pass starts at {start} but {len(self.sums)} tokens are tracked")
        cs = np.asarray(col_sums, dtype=np.float64)[:total]
        self.sums = np.concatenate((self.sums, np.zeros(n_rows)))
        self.rows = np.concatenate((self.rows, np.zeros(n_rows, dtype=np.int64)))
        self.sums += cs
        self.rows[:start] += n_rows
        self.rows[start:] += np.arange(n_rows, 0, -1)  # row r sees tokens <= r

    def skip(self, n_tokens: int) -> None:
        """Track `n_tokens` more tokens whose K/V came from elsewhere (no pass seen: density 0)."""
        self.sums = np.concatenate((self.sums, np.zeros(n_tokens)))
        self.rows = np.concatenate((self.rows, np.zeros(n_tokens, dtype=np.int64)))

    def truncate(self, n_tokens: int) -> None:
        """Forget tokens from `n_tokens` on (draft rows that lookup decoding did not keep). The rows
        they were counted as stay in the earlier tokens' counts, with the attention those rows paid:
        a rejected draft row is a query of the context like any other."""
        self.sums, self.rows = self.sums[:n_tokens], self.rows[:n_tokens]

    def token_density(self) -> np.ndarray:
        rows = np.maximum(self.rows, 1)
        return self.sums / rows / self.norm

    def chunk_density(self, chunk_tokens: int) -> np.ndarray:
        """Mean token density per chunk; the last chunk may be partial."""
        d = self.token_density()
        n = len(d)
        if n == 0:
            return np.zeros(0)
        edges = np.arange(0, n, chunk_tokens)
        sums = np.add.reduceat(d, edges)
        counts = np.diff(np.append(edges, n))
        return sums / counts

    def reset(self) -> None:
        self.sums = np.zeros(0, dtype=np.float64)
        self.rows = np.zeros(0, dtype=np.int64)
