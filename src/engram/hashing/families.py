"""Hash families: one family's constants and how they derive, and the registry that finds a family by name.

A `HashFamily` holds the compression (token id -> x), the pad, the multipliers m and the primes p,
whether an id (EOS) starts a new document, and the dtype of the row ids it hands out. `DeepSeekFamily`
is the reference demo's (multipliers from `numpy.random.default_rng(seed + 10007 * layer_id)`, distinct
primes across heads, orders and layers); other families live beside their integration
(`integrations/qwen4_exp/`, `integrations/deepseek_v41/`, `integrations/longcat.py`), which declare
them as entry points (group `engram.hash_families`); `family_class` finds one by its manifest name and imports
it only when asked for, so the core names no integration. Every family is hashed by the one
engine, `engine.NgramHashMapping`: the XOR-of-products mix reduced modulo each head's size, or, for a
family with `own_mix` (LongCat's sums of token ids times powers of the vocabulary), the family's own
`mix_rows` over the same per-position windows.
"""

from __future__ import annotations

import base64
from typing import ClassVar

import numpy as np
import torch

from ..config import ConfigError, EngramConfig
from ..tokenizer import CompressedTokenizer, lookup_table_bytes
from .identity import SPEC_FORMAT

PRIME_1 = 10007
HASH_MODES = ("ngram", "shuffled", "constant")


def _isprime(n: int) -> bool:
    from sympy import isprime

    return bool(isprime(n))


def next_unused_prime(start: int, taken: set[int]) -> int:
    """Smallest prime > start that is not in `taken` (the reference's `find_next_prime`)."""
    candidate = start + 1
    while candidate in taken or not _isprime(candidate):
        candidate += 1
    return candidate


def layer_multipliers(layer_ids, max_ngram_size: int, compressed_vocab: int, seed: int) -> dict[int, np.ndarray]:
    """Per layer, `max_ngram_size` odd int64 multipliers drawn exactly as the reference draws them."""
    max_long = np.iinfo(np.int64).max
    half_bound = max(1, int(max_long // compressed_vocab) // 2)
    out = {}
    for layer_id in layer_ids:
        rng = np.random.default_rng(int(seed + PRIME_1 * int(layer_id)))
        r = rng.integers(low=0, high=half_bound, size=(max_ngram_size,), dtype=np.int64)
        out[int(layer_id)] = r * 2 + 1
    return out


def head_moduli(layer_ids, engram_vocab_size, max_ngram_size: int, n_head_per_ngram: int) -> dict[int, list[list[int]]]:
    """Prime table size of every head: `{layer_id: [[p for head] for order 2..N]}` (reference order)."""
    taken: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer_id in layer_ids:
        per_order = []
        for n in range(2, max_ngram_size + 1):
            start = int(engram_vocab_size[n - 2]) - 1
            heads = []
            for _ in range(n_head_per_ngram):
                p = next_unused_prime(start, taken)
                taken.add(p)
                heads.append(p)
                start = p
            per_order.append(heads)
        out[int(layer_id)] = per_order
    return out


class HashFamily:
    """One hash family: its constants and how they derive (subclasses set them in `__init__`).

    Attributes every family sets:
      `layer_ids`, `max_ngram_size` (N), `n_head_per_ngram` (heads per order),
      `compressed_tokenizer` (token id -> x: a `CompressedTokenizer` or `RawIds`),
      `raw_pad_id` (token id of the pad) and `compressed_pad_id` (its x), `reset_id` (a token id after which a new
      document starts, or None), `layer_multipliers[layer]` (int64 `[N]`), `vocab_size_across_layers[layer]` (the head
      moduli, `[[p] * heads] * (N-1)`; both the reference's names),
      `seed`, `hash_mode` ("ngram", or an ablation: "shuffled", "constant").
    Class attributes: `name` (the manifest's "family"), `formula`, `index_dtype` (the dtype of the row ids
    `hash` returns: int64, or int32 where a released model hands out int32 ids).
    Subclasses give `config_spec()` (their constants, for the manifest) and `from_spec(spec, tokenizer)`.

    Two optional departures from the reference's scheme (both off by default):
      `reset_reads_pad`: the reset id's own position reads the pad too, as a DEAD position does (an EOS
      is then an empty n-gram: vLLM's LongCat negates EOS ids in its token table);
      `own_mix`: the family mixes each position's window itself: `mix_rows(windows)` takes the N tensors
      (B*T,) of x_{t-k} (the pad where position t-k lies before the document's start) and returns the
      per-head rows (L, B*T, H) int64, offsets not added.
    """

    name: ClassVar[str] = ""
    formula: ClassVar[str] = ""
    index_dtype: ClassVar[torch.dtype] = torch.int64
    reset_id: int | None = None
    reset_reads_pad: bool = False
    own_mix: ClassVar[bool] = False
    hash_mode: str = "ngram"

    @property
    def pad_id(self) -> int:
        """The reference's name of `compressed_pad_id` (its `NgramHashMapping.pad_id`: the pad's x, not its token
        id; `EngramConfig.pad_id` is the token id, here `raw_pad_id`). engram's own code reads `compressed_pad_id`."""
        return self.compressed_pad_id

    @property
    def multipliers(self) -> dict:
        """Alias of `layer_multipliers` (the name the manifest's per-layer key keeps)."""
        return self.layer_multipliers

    @property
    def moduli(self) -> dict:
        """Alias of `vocab_size_across_layers` (the head moduli)."""
        return self.vocab_size_across_layers

    def mix_rows(self, windows: list[torch.Tensor]) -> torch.Tensor:
        """(L, B*T, H) int64 per-head rows from the N windows (B*T,) (families with `own_mix` only)."""
        raise NotImplementedError

    # ---- derived layout
    @property
    def raw_vocab_size(self) -> int:
        """Token ids accepted: [0, raw_vocab_size)."""
        return self.compressed_tokenizer.vocab_size

    @property
    def compressed_vocab_size(self) -> int:
        """Distinct x values after compression (the multipliers' bound derives from it)."""
        return self.compressed_tokenizer.num_new_token

    def head_sizes(self, layer_id: int) -> list[int]:
        """Flat list of the layer's per-head table sizes, in hash-column order."""
        return [p for order in self.vocab_size_across_layers[int(layer_id)] for p in order]

    def head_offsets(self, layer_id: int) -> list[int]:
        """Row offset of each head inside the layer's concatenated table."""
        sizes = self.head_sizes(layer_id)
        return [int(v) for v in np.concatenate([[0], np.cumsum(sizes)[:-1]])]

    @property
    def max_prime(self) -> int:
        return max(p for lid in self.layer_ids for p in self.head_sizes(lid))

    # ---- manifest
    def config_spec(self) -> dict:
        """The family's own constants, in manifest order (everything but format/family/layers/formula)."""
        raise NotImplementedError

    def layers_spec(self) -> dict:
        return {str(lid): {"multipliers": [int(m) for m in self.layer_multipliers[lid]],
                           "head_moduli": self.vocab_size_across_layers[lid],
                           "head_offsets": self.head_offsets(lid), "table_rows": int(sum(self.head_sizes(lid)))}
                for lid in self.layer_ids}

    def spec(self, include_lookup_table: bool = False) -> dict:
        """A self-describing manifest: everything another runtime needs to hash identically."""
        d = {"format": SPEC_FORMAT, "family": self.name, **self.config_spec(), "layers": self.layers_spec(),
             "formula": self.formula}
        if include_lookup_table and isinstance(self.compressed_tokenizer, CompressedTokenizer):
            d["lookup_table_int32_le_b64"] = base64.b64encode(lookup_table_bytes(
                self.compressed_tokenizer.lookup_table)).decode("ascii")
        return d

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "HashFamily":
        raise NotImplementedError


class DeepSeekFamily(HashFamily):
    """The reference demo's family: compressed ids, per-layer `default_rng` multipliers, distinct primes."""

    name = "deepseek"
    formula = (
        "x = lookup_table[token_id]; positions t<0 read compressed_pad_id; for layer L, order n in 2..max_ngram_size, "
        "mix = XOR_{k<n} (x_{t-k} * multipliers[k]) in wrapping int64; head j of order n: row = mix floor-mod "
        "head_moduli[n-2][j]; table row = row + head_offsets[(n-2)*n_head_per_ngram + j]"
    )

    def __init__(self, engram_vocab_size, max_ngram_size, n_embed_per_ngram, n_head_per_ngram, layer_ids,
                 tokenizer_name_or_path=None, pad_id=2, seed=0, *,
                 compressed_tokenizer: CompressedTokenizer | None = None, compress: bool = True,
                 hash_mode: str = "ngram"):
        # Reuse EngramConfig's validation so both entry points reject the same inputs.
        EngramConfig(
            engram_vocab_size=list(engram_vocab_size), max_ngram_size=max_ngram_size,
            n_embed_per_ngram=n_embed_per_ngram, n_head_per_ngram=n_head_per_ngram,
            layer_ids=list(layer_ids), pad_id=pad_id, seed=seed,
        )
        if hash_mode not in HASH_MODES:
            raise ConfigError(f"hash_mode must be 'ngram', 'shuffled' or 'constant', got {hash_mode!r}")
        self.vocab_size_per_ngram = list(engram_vocab_size)
        self.max_ngram_size = int(max_ngram_size)
        self.n_embed_per_ngram = int(n_embed_per_ngram)
        self.n_head_per_ngram = int(n_head_per_ngram)
        self.layer_ids = [int(i) for i in layer_ids]
        self.seed = int(seed)
        self.compressed_tokenizer = compressed_tokenizer or CompressedTokenizer(tokenizer_name_or_path)
        if not compress:  # ablation: hash raw token ids (identity "compression")
            self.compressed_tokenizer = CompressedTokenizer.identity(self.compressed_tokenizer)
        self.compress, self.hash_mode = bool(compress), hash_mode
        if not 0 <= pad_id < self.raw_vocab_size:
            raise ConfigError(f"pad_id {pad_id} is outside the tokenizer's id range [0, {self.raw_vocab_size})")
        self.raw_pad_id = int(pad_id)
        self.compressed_pad_id = int(self.compressed_tokenizer.lookup_table[pad_id])
        self.layer_multipliers = layer_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size,
                                                   self.seed)
        self.vocab_size_across_layers = head_moduli(self.layer_ids, self.vocab_size_per_ngram, self.max_ngram_size,
                                                    self.n_head_per_ngram)

    @classmethod
    def from_config(cls, cfg: EngramConfig, compressed_tokenizer: CompressedTokenizer | None = None
                    ) -> "DeepSeekFamily":
        return cls(cfg.engram_vocab_size, cfg.max_ngram_size, cfg.n_embed_per_ngram, cfg.n_head_per_ngram,
                   cfg.layer_ids, cfg.tokenizer_name_or_path, cfg.pad_id, cfg.seed,
                   compressed_tokenizer=compressed_tokenizer, compress=cfg.compress_tokenizer, hash_mode=cfg.hash_mode)

    def config_spec(self) -> dict:
        ct = self.compressed_tokenizer
        return {
            "tokenizer_file": ct.tokenizer_file.name if ct.tokenizer_file is not None else "tokenizer.json",
            "tokenizer_sha256": ct.tokenizer_sha256,
            "tokenizer_len": self.raw_vocab_size,
            "compressed_vocab_size": self.compressed_vocab_size,
            "lookup_table_sha256": ct.lookup_sha256,
            "pad_id": self.raw_pad_id,
            "compressed_pad_id": self.compressed_pad_id,
            "max_ngram_size": self.max_ngram_size,
            "n_embed_per_ngram": self.n_embed_per_ngram,
            "n_head_per_ngram": self.n_head_per_ngram,
            "engram_vocab_size": self.vocab_size_per_ngram,
            "seed": self.seed,
            "compress_tokenizer": self.compress,
            "hash_mode": self.hash_mode,
            "layer_ids": self.layer_ids,
        }

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "DeepSeekFamily":
        ct = CompressedTokenizer(tokenizer)
        if ct.tokenizer_sha256 != spec["tokenizer_sha256"]:
            raise ConfigError(
                f"tokenizer mismatch: the spec was made with tokenizer sha256 {spec['tokenizer_sha256'][:16]}..., "
                f"but {ct.tokenizer_file} has {ct.tokenizer_sha256[:16]}...; pass the tokenizer the spec was made with"
            )
        if ct.lookup_sha256 != spec["lookup_table_sha256"]:
            raise ConfigError("lookup table mismatch: the compression built from this tokenizer differs from the "
                              "spec's")
        return cls(spec["engram_vocab_size"], spec["max_ngram_size"], spec["n_embed_per_ngram"],
                   spec["n_head_per_ngram"], spec["layer_ids"], None, spec["pad_id"], spec["seed"],
                   compressed_tokenizer=ct, compress=spec.get("compress_tokenizer", True),
                   hash_mode=spec.get("hash_mode", "ngram"))


# Families by manifest name -> class. The core knows only its own; the released models' families live in their
# integrations and are found by the entry-point group below (pyproject.toml: `engram.hash_families`), so the
# core imports no integration, even by a string. Another package can add a family the same way, or at run time
# with `register_family`.
ENTRY_POINTS = "engram.hash_families"
FAMILIES: dict[str, type[HashFamily]] = {"deepseek": DeepSeekFamily}


def register_family(name: str, cls: type[HashFamily]) -> None:
    """Make a family known by its manifest name (what `spec["family"]` says)."""
    FAMILIES[name] = cls


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def known_families() -> list[str]:
    """Every family a manifest may name: registered ones and those the installed packages declare."""
    return sorted(set(FAMILIES) | set(_entry_points()))


def family_class(name: str) -> type[HashFamily]:
    """The family class a manifest names (`spec["family"]`); a declared one is imported on first use."""
    if name not in FAMILIES:
        ep = _entry_points().get(name)
        if ep is None:
            raise ConfigError(f"unknown hash family {name!r} (known: {', '.join(known_families())}); the package "
                              f"that defines it must be installed (its entry point in {ENTRY_POINTS!r})")
        FAMILIES[name] = ep.load()
    return FAMILIES[name]
