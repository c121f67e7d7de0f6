"""`engram stats`: what the tables see. Tokenizer compression, per-head row usage and collisions vs
table size on a corpus, and the rank-frequency (Zipf) curve of the n-grams."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..hashing import layer_multipliers, next_unused_prime
from ..tokenizer import CompressedTokenizer, load_tokenizer
from ..training.data import load_manifest, load_split, prepare

ZIPF_TOP = 100  # `zipf_top`: the share of occurrences the top 1/ZIPF_TOP of an order's distinct n-grams cover


def compression_report(ct, tokenizer, top: int = 5) -> dict:
    """Compression ratio and the largest groups of token ids merged into one compressed id."""
    table = ct.lookup_table
    n, m = len(table), int(table.max()) + 1
    counts = np.bincount(table, minlength=m)
    groups = []
    for cid in np.argsort(-counts, kind="stable")[:top]:
        members = np.nonzero(table == cid)[0]
        groups.append({"compressed_id": int(cid), "size": int(len(members)),
                       "tokens": [tokenizer.decode([int(i)]) for i in members[:12]]})
    return {"vocab": n, "compressed": m, "reduction": 1 - m / n, "largest_groups": groups}


def shared_rows(rows: np.ndarray) -> tuple[int, float]:
    """`rows[i]`: the row distinct n-gram i lands in. Returns (rows used, the fraction of distinct n-grams whose
    row also holds another distinct n-gram). The second is the collision measure: (distinct - rows used) /
    distinct counts only the n-grams beyond the first in each row and understates it (3 n-grams in one row:
    all 3 collide, that count says 2)."""
    _, counts = np.unique(rows, return_counts=True)
    return int(len(counts)), float(counts[counts > 1].sum() / len(rows)) if len(rows) else 0.0


def row_usage(compressed: np.ndarray, sizes: list[int], max_ngram: int = 3, seed: int = 0, pad: int = 0) -> list[dict]:
    """For each n-gram order and table size p: distinct n-grams, rows used by one head hashing into p
    rows (the reference's multiplier-XOR hash), and `collision_rate`, the fraction of distinct n-grams that
    share their row with another (`shared_rows`)."""
    x = compressed.astype(np.int64)
    vocab = int(x.max()) + 1
    mult = layer_multipliers([0], max_ngram, vocab, seed)[0]
    out = []
    for n in range(2, max_ngram + 1):
        win = np.stack([np.concatenate([np.full(k, pad), x[: len(x) - k]]) for k in range(n)])  # (n, N)
        mix = win[0] * mult[0]
        for k in range(1, n):
            mix = mix ^ (win[k] * mult[k])
        uniq = np.unique(mix)  # distinct n-grams (the mix is injective enough to count them)
        for size in sizes:
            p = next_unused_prime(size - 1, set())
            used, shared = shared_rows(uniq % p)
            out.append({"order": n, "table_rows": p, "distinct_ngrams": int(len(uniq)), "rows_used": used,
                        "row_usage": used / p, "collision_rate": shared})
    return out


def zipf(compressed: np.ndarray, max_ngram: int = 3) -> dict[int, np.ndarray]:
    """Sorted n-gram counts (descending) per order."""
    x = compressed.astype(np.int64)
    V = int(x.max()) + 1
    res = {}
    key = x.copy()
    for n in range(2, max_ngram + 1):
        key = key[:-1] * V + x[n - 1:]  # n-gram ending at each position, as one integer
        _, c = np.unique(key, return_counts=True)
        res[n] = np.sort(c)[::-1]
    return res


def plot_zipf(counts: dict[int, np.ndarray], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, c in counts.items():
        ax.loglog(np.arange(1, len(c) + 1), c, label=f"{n}-grams")
    ax.set_xlabel("rank")
    ax.set_ylabel("count")
    ax.set_title("n-gram rank-frequency (train split, compressed ids)")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def mapping_usage(mapping, ids: np.ndarray, chunk: int = 1 << 16) -> list[dict]:
    """How a model's own hashing uses its tables on token ids `ids` (one long sequence): per layer and head,
    the distinct n-grams of the head's order, the rows they land in, the share of the head's rows used and
    the share of distinct n-grams that share their row with another (`shared_rows`). Any family (`deepseek`,
    `qwen4_exp`, `deepseek_v41`)."""
    ids = np.asarray(ids, dtype=np.int64)
    cols = []
    for s in range(0, len(ids), chunk):  # hashed in chunks, each continuing from the ids before it
        hist = ids[max(0, s - (mapping.max_ngram_size - 1)):s]
        cur = ids[s:s + chunk]
        h = mapping.hash_continuation(torch.from_numpy(cur[None]), torch.from_numpy(hist[None]) if len(hist) else None)
        cols.append({lid: np.asarray(v[0]) for lid, v in h.items()})
    x = mapping.compressed_tokenizer.lookup_table[ids]
    out, H = [], mapping.n_head_per_ngram
    for lid in mapping.layer_ids:
        rows = np.concatenate([c[lid] for c in cols])  # (T, (N-1)*H)
        for n in range(2, mapping.max_ngram_size + 1):
            win = np.stack([np.concatenate([np.full(k, mapping.pad_id), x[: len(x) - k]]) for k in range(n)], 1)
            _, first = np.unique(win, axis=0, return_index=True)  # one position per distinct n-gram (exact tuples)
            distinct = len(first)
            for j, p in enumerate(mapping.vocab_size_across_layers[lid][n - 2]):
                used, shared = shared_rows(rows[first, (n - 2) * H + j])
                out.append({"layer": lid, "order": n, "head": j, "head_rows": int(p), "distinct_ngrams": distinct,
                            "rows_used": used, "row_usage": used / p, "collision_rate": shared})
    return out


def report(data: list[str] | None, tokenizer: str, sizes: list[int]) -> dict:
    """Everything `engram stats` prints for a corpus: compression, row usage per table size, n-gram counts."""
    d = prepare(data, tokenizer)
    m = load_manifest(d)
    ct = CompressedTokenizer(m["tokenizer_file"])
    comp = ct(np.asarray(load_split(d, "train"), dtype=np.int64))
    z = zipf(comp)
    return {"tokenizer_file": m["tokenizer_file"],
            "compression": compression_report(ct, load_tokenizer(m["tokenizer_file"])),
            "train_tokens": len(comp), "row_usage": row_usage(comp, sizes), "zipf": z,
            "zipf_top": {n: {"distinct": len(c),
                             "top1pct_share": float(c[: max(1, len(c) // ZIPF_TOP)].sum() / c.sum())}
                         for n, c in z.items()}}


def record(r: dict, path: Path, command: str) -> dict:
    """`engram stats --record FILE`: what `report` measured (without the raw n-gram counts), the command and the
    environment, as the record `engram results` renders (`{{table:stats}}`, `{{value:stats/...}}`)."""
    from ..persist import write_json
    from ..utils import environment

    rec = {"experiment": "stats", "command": command, "environment": environment(),
           "tokenizer": Path(r["tokenizer_file"]).name, "train_tokens": int(r["train_tokens"]),
           "compression": r["compression"], "row_usage": r["row_usage"],
           "zipf_top": {str(n): v for n, v in r["zipf_top"].items()}}
    write_json(Path(path), rec)
    return rec


def frequent_ngram_mask(train_tokens: np.ndarray, tokens: np.ndarray, min_count: int = 20) -> np.ndarray:
    """True where token t completes a trigram or bigram seen >= min_count times in the train split
    (the static, multi-token patterns: names, set phrases, speaker tags)."""
    tr = train_tokens.astype(np.int64)
    V = int(max(tr.max(), tokens.max())) + 1
    big = tr[:-1] * V + tr[1:]
    tri = (tr[:-2] * V + tr[1:-1]) * V + tr[2:]
    ub, cb = np.unique(big, return_counts=True)
    ut, ctr = np.unique(tri, return_counts=True)
    x = tokens.astype(np.int64)
    mask = np.zeros(x.shape, dtype=bool)
    mask[:, 2:] |= np.isin((x[:, :-2] * V + x[:, 1:-1]) * V + x[:, 2:], ut[ctr >= min_count])
    mask[:, 1:] |= np.isin(x[:, :-1] * V + x[:, 1:], ub[cb >= min_count]) & ~np.isin(x[:, 1:], (0, 1))
    return mask
