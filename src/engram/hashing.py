"""N-gram hashing: token ids -> per-head row indices into the Engram tables (pure, no nn.Module).

For every Engram layer, n-gram order n = 2..N and head k, position t gets

    mix_n(t) = (x_t * m_0) XOR (x_{t-1} * m_1) XOR ... XOR (x_{t-n+1} * m_{n-1})   (wrapping int64)
    row      = mix_n(t) mod p_{n,k}                                              (floor modulo)

over (compressed) ids x; positions before the start read the pad id. Two ideas live here:

- A `HashFamily` holds one family's constants and how they derive: the compression (token id ->
  x), the pad, the multipliers m and the primes p, and whether an id (EOS) starts a new document.
  `DeepSeekFamily` is the reference demo's (multipliers from `numpy.random.default_rng(seed +
  10007 * layer_id)`, distinct primes across heads, orders and layers); other families live beside
  their integration (`integrations/qwen4_exp.py`) and are found by name (`family_class`).
  `spec()` is a family's self-describing manifest and `spec_identity()` the part of it that decides
  which row an n-gram reads: the one thing models, adapters, overlays and checkpoints compare.
- `NgramHashMapping` is the one hashing engine for any family: it validates ids and dispatches to
  the fused kernel or the torch path. Its constructor keeps the reference's signature (and builds
  a `DeepSeekFamily`); `NgramHashMapping.for_family(family)` takes any other.

Bit-identical to the reference `NgramHashMapping` (checked against `golden/hash_default.json` in the tests).

Speed: the reference spends most of its time in one int64 modulo per head. We split each
mix into a signed high and an unsigned low 32-bit half, `mix = hi * 2^32 + lo`, so that
`mix mod p = ((hi mod p) * (2^32 mod p) + lo) mod p`; for p <= 2^26 the bracket is an integer
below 2^53, exact in float64, and float64 floor-divisions (corrected by one p where rounding
lands on the wrong side) finish the job: that is the torch path (GPU, or CPU without numba).
On CPU a fused numba kernel (`engram-torch[fast]`, `_fasthash.py`) does all heads of all layers in
one parallel pass with a three-way split, `mix = hi * 2^48 + mid * 2^32 + lo`, that needs a
single floor-division per head, SIMD across tokens, optionally adding the head offsets
(`hash(..., offsets=True)`); it is exact for p <= 2^36. Larger primes fall back to int64
`torch.remainder`.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .errors import EngramError
from . import _fasthash
from .config import ConfigError, EngramConfig
from .persist import atomic_write_bytes, read_json
from .tokenizer import CompressedTokenizer, RawIds

PRIME_1 = 10007
SPEC_FORMAT = "engram-hash-spec/1"
IDENTITY_KEYS = ("family", "lookup_table_sha256", "compressed_pad_id", "layers")


class HashInputError(EngramError, ValueError):
    """Input ids have the wrong type, shape or values; the message names the first problem."""


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


def document_starts(ids: np.ndarray, reset_id: int) -> np.ndarray:
    """(B, T) int64: the first position of each token's document, a document ending at each `reset_id` (inclusive)."""
    B, T = ids.shape
    pos = np.arange(T, dtype=np.int64)
    eos = np.where(ids == reset_id, pos, -1)
    last = np.maximum.accumulate(eos, axis=1) if T else eos
    return np.concatenate([np.full((B, 1), -1, dtype=np.int64), last[:, :-1]], axis=1)[:, :T] + 1


# ------------------------------------------------------------------------------------------ families


class HashFamily:
    """One hash family: its constants and how they derive (subclasses set them in `__init__`).

    Attributes every family sets:
      `layer_ids`, `max_ngram_size` (N), `n_head_per_ngram` (heads per order),
      `compressed_tokenizer` (token id -> x: a `CompressedTokenizer` or `RawIds`),
      `raw_pad_id` (token id of the pad) and `pad_id` (its x), `reset_id` (a token id that starts a new
      document, or None), `multipliers[layer]` (int64 `[N]`), `moduli[layer]` (`[[p] * heads] * (N-1)`),
      `seed`, `hash_mode` ("ngram", or an ablation: "shuffled", "constant").
    Subclasses give `name`, `formula`, `config_spec()` (their constants, for the manifest) and
    `from_spec(spec, tokenizer)`.
    """

    name: ClassVar[str] = ""
    formula: ClassVar[str] = ""
    mapping_class: ClassVar[type | None] = None  # an engine subclass the family needs (None: NgramHashMapping)
    reset_id: int | None = None
    hash_mode: str = "ngram"

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
        return [p for order in self.moduli[int(layer_id)] for p in order]

    def head_offsets(self, layer_id: int) -> list[int]:
        """Row offset of each head inside the layer's concatenated table."""
        sizes = self.head_sizes(layer_id)
        return [int(v) for v in np.concatenate([[0], np.cumsum(sizes)[:-1]])]

    @property
    def max_prime(self) -> int:
        return max(p for l in self.layer_ids for p in self.head_sizes(l))

    # ---- manifest
    def config_spec(self) -> dict:
        """The family's own constants, in manifest order (everything but format/family/layers/formula)."""
        raise NotImplementedError

    def layers_spec(self) -> dict:
        return {str(l): {"multipliers": [int(m) for m in self.multipliers[l]], "head_moduli": self.moduli[l],
                         "head_offsets": self.head_offsets(l), "table_rows": int(sum(self.head_sizes(l)))}
                for l in self.layer_ids}

    def spec(self, include_lookup_table: bool = False) -> dict:
        """A self-describing manifest: everything another runtime needs to hash identically."""
        d = {"format": SPEC_FORMAT, "family": self.name, **self.config_spec(), "layers": self.layers_spec(),
             "formula": self.formula}
        if include_lookup_table and isinstance(self.compressed_tokenizer, CompressedTokenizer):
            lut = self.compressed_tokenizer.lookup_table.astype("<i4").tobytes()
            d["lookup_table_int32_le_b64"] = base64.b64encode(lut).decode("ascii")
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
        if hash_mode not in ("ngram", "shuffled", "constant"):
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
        self.pad_id = int(self.compressed_tokenizer.lookup_table[pad_id])
        self.multipliers = layer_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size, self.seed)
        self.moduli = head_moduli(self.layer_ids, self.vocab_size_per_ngram, self.max_ngram_size, self.n_head_per_ngram)

    @classmethod
    def from_config(cls, cfg: EngramConfig, compressed_tokenizer: CompressedTokenizer | None = None) -> "DeepSeekFamily":
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
            "compressed_pad_id": self.pad_id,
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
            raise ConfigError("lookup table mismatch: the compression built from this tokenizer differs from the spec's")
        return cls(spec["engram_vocab_size"], spec["max_ngram_size"], spec["n_embed_per_ngram"],
                   spec["n_head_per_ngram"], spec["layer_ids"], None, spec["pad_id"], spec["seed"],
                   compressed_tokenizer=ct, compress=spec.get("compress_tokenizer", True),
                   hash_mode=spec.get("hash_mode", "ngram"))


# Families by manifest name: "module:Class", imported when first asked for (integrations stay optional).
FAMILIES: dict[str, str] = {
    "deepseek": "engram.hashing:DeepSeekFamily",
    "qwen4_exp": "engram.integrations.qwen4_exp:Qwen4ExpFamily",
    "deepseek_v41": "engram.integrations.deepseek_v41:DeepSeekV41Family",
}


def register_family(name: str, target: str) -> None:
    """Make a family known by its manifest name; `target` is "package.module:ClassName"."""
    FAMILIES[name] = target


def family_class(name: str) -> type[HashFamily]:
    if name not in FAMILIES:
        raise ConfigError(f"unknown hash family {name!r} (known: {', '.join(sorted(FAMILIES))})")
    module, cls = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


# ------------------------------------------------------------------------------------------ identity


def spec_identity(spec: dict) -> dict:
    """What decides which row an n-gram reads, from a manifest: family, lookup table, pad, every layer's
    multipliers, primes and offsets. Models, adapters, overlays and checkpoints compare exactly this."""
    if not isinstance(spec, dict):
        raise ConfigError("hash manifest is not a JSON object")
    return {"family": spec.get("family", "deepseek"), **{k: spec.get(k) for k in IDENTITY_KEYS[1:]}}


def identity_digest(spec: dict) -> str:
    """sha256 of `spec_identity(spec)`: what an overlay records as `hash_spec_sha256`."""
    return hashlib.sha256(json.dumps(spec_identity(spec), sort_keys=True).encode()).hexdigest()


def legacy_identity_digest(spec: dict) -> str:
    """The digest overlays written before 0.2 recorded (it also covered the tokenizer file's sha256)."""
    keep = {k: spec.get(k) for k in ("family", "tokenizer_sha256", "lookup_table_sha256", "compressed_pad_id", "layers")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def check_identity(mine: dict, saved: dict, what: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the first key where manifest `saved` (of `what`) hashes differently from `mine`."""
    a, b = spec_identity(saved), spec_identity(mine)
    if a["family"] != b["family"]:
        raise error(f"{what}: hash manifest of family {a['family']!r}, this model hashes with {b['family']!r}: the "
                    "table rows would be addressed differently; use the manifest saved with this model")
    for key in IDENTITY_KEYS[1:]:
        if a[key] != b[key]:
            raise error(f"{what}: hashing mismatch on {key!r}: it was made for other hashing constants (tokenizer, "
                        "lookup table, multipliers or primes) than this installation derives; its Engram rows would "
                        "be garbage. Use the tokenizer and hash manifest (engram_hash_spec.json) saved with it")


# ------------------------------------------------------------------------------------------ the engine


def _from_family(attr: str, doc: str = ""):
    return property(lambda self: getattr(self.family, attr), doc=doc or f"The family's `{attr}`.")


def _first_bad(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


class NgramHashMapping:
    """The hashing engine: validates ids, dispatches to the fused kernel or the torch path, for any family.

    `NgramHashMapping(engram_vocab_size, ..., seed)` keeps the reference's constructor and attributes
    (`layer_multipliers`, `vocab_size_across_layers`, `compressed_tokenizer`, `pad_id`,
    `tokenizer_vocab_size`) and hashes the `DeepSeekFamily`; `NgramHashMapping.for_family(f)` any other.
    """

    def __init__(
        self,
        engram_vocab_size,
        max_ngram_size,
        n_embed_per_ngram,
        n_head_per_ngram,
        layer_ids,
        tokenizer_name_or_path=None,
        pad_id=2,
        seed=0,
        *,
        compressed_tokenizer: CompressedTokenizer | None = None,
        backend: str = "auto",
        compress: bool = True,
        hash_mode: str = "ngram",
    ):
        family = DeepSeekFamily(engram_vocab_size, max_ngram_size, n_embed_per_ngram, n_head_per_ngram, layer_ids,
                                tokenizer_name_or_path, pad_id, seed, compressed_tokenizer=compressed_tokenizer,
                                compress=compress, hash_mode=hash_mode)
        self._bind(family, backend)

    def _bind(self, family: HashFamily, backend: str) -> None:
        if backend not in ("auto", "numba", "torch"):
            raise ConfigError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
        self.family, self.backend = family, backend
        self.max_prime = family.max_prime
        self._device_cache: dict[Any, tuple] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_family(cls, family: HashFamily, backend: str = "auto") -> "NgramHashMapping":
        """The engine over any `HashFamily`."""
        self = cls.__new__(cls)
        self._bind(family, backend)
        return self

    @classmethod
    def from_config(cls, cfg: EngramConfig, compressed_tokenizer: CompressedTokenizer | None = None) -> "NgramHashMapping":
        return cls.for_family(DeepSeekFamily.from_config(cfg, compressed_tokenizer))

    @classmethod
    def qwen4_exp(cls, vocab_size: int, ngram_size: int, heads_per_ngram: int, ple_layer_ids, ngram_vocab_size_base: int,
                  seed: int, eos_token_id: int, backend: str = "auto") -> "NgramHashMapping":
        """The `qwen4_exp` family's engine (`engram.integrations.qwen4_exp.Qwen4ExpFamily` documents it)."""
        fam = family_class("qwen4_exp")(vocab_size, ngram_size, heads_per_ngram, ple_layer_ids, ngram_vocab_size_base,
                                        seed, eos_token_id)
        return cls.for_family(fam, backend)

    # The family's constants under the reference's attribute names.
    layer_ids = _from_family("layer_ids")
    max_ngram_size = _from_family("max_ngram_size")
    n_head_per_ngram = _from_family("n_head_per_ngram")
    n_embed_per_ngram = property(lambda self: getattr(self.family, "n_embed_per_ngram", None))
    vocab_size_per_ngram = property(lambda self: getattr(self.family, "vocab_size_per_ngram", None))
    seed = _from_family("seed")
    compressed_tokenizer = _from_family("compressed_tokenizer")
    compress = property(lambda self: getattr(self.family, "compress", False))
    hash_mode = _from_family("hash_mode")
    pad_id = _from_family("pad_id", "The pad's compressed id (what positions before the start read).")
    raw_pad_id = _from_family("raw_pad_id", "The pad's token id.")
    reset_id = _from_family("reset_id")
    layer_multipliers = _from_family("multipliers", "`{layer_id: int64 [max_ngram_size]}` (reference name).")
    vocab_size_across_layers = _from_family("moduli", "`{layer_id: [[p] * heads] * orders}` (reference name).")
    raw_vocab_size = _from_family("raw_vocab_size", "Token ids accepted: [0, raw_vocab_size).")
    compressed_vocab_size = _from_family("compressed_vocab_size", "Distinct compressed ids.")
    tokenizer_vocab_size = compressed_vocab_size  # the reference's name for the compressed size

    @property
    def tokenizer_len(self) -> int:
        """Deprecated alias of `raw_vocab_size`."""
        warnings.warn("NgramHashMapping.tokenizer_len is deprecated: use raw_vocab_size", DeprecationWarning, 2)
        return self.raw_vocab_size

    def head_sizes(self, layer_id: int) -> list[int]:
        """Flat list of the layer's per-head table sizes, in hash-column order."""
        return self.family.head_sizes(layer_id)

    def head_offsets(self, layer_id: int) -> list[int]:
        """Row offset of each head inside the layer's concatenated table."""
        return self.family.head_offsets(layer_id)

    # ------------------------------------------------------------------ hashing
    def _tensors(self, device: torch.device):
        key = ("tensors", str(device))
        if key not in self._device_cache:
            lut = torch.from_numpy(self.compressed_tokenizer.lookup_table).to(device)
            mult = torch.tensor(np.stack([self.layer_multipliers[l] for l in self.layer_ids]), device=device)
            primes = torch.tensor([self.vocab_size_across_layers[l] for l in self.layer_ids], dtype=torch.int64, device=device)
            L, O, H = primes.shape
            p64 = primes.to(torch.float64).view(L, O, H, 1)
            c64 = torch.remainder(torch.full_like(primes, 1 << 32), primes).to(torch.float64).view(L, O, H, 1)
            self._device_cache[key] = (lut, mult, primes, p64, c64)
        return self._device_cache[key]

    def validate(self, input_ids) -> None:
        """Raise `HashInputError` unless `input_ids` is a 2-D integer array of ids in [0, len(tokenizer))."""
        if isinstance(input_ids, torch.Tensor):
            dtype_ok = not (input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool)
            dtype_name = str(input_ids.dtype)
        elif isinstance(input_ids, np.ndarray):
            dtype_ok = np.issubdtype(input_ids.dtype, np.integer)
            dtype_name = str(input_ids.dtype)
        else:
            raise HashInputError(
                f"input_ids must be a numpy array or torch tensor of shape [B, T], got {type(input_ids).__name__}; "
                "wrap lists with np.array(...)"
            )
        if not dtype_ok:
            raise HashInputError(f"input_ids must hold integer token ids, got dtype {dtype_name}; cast with .long() / .astype(np.int64)")
        if input_ids.ndim != 2:
            raise HashInputError(
                f"input_ids must be 2-D [batch, seq_len], got {input_ids.ndim}-D shape {tuple(input_ids.shape)}; "
                "add a batch dimension with x[None] / x.unsqueeze(0)"
            )
        if input_ids.numel() if isinstance(input_ids, torch.Tensor) else input_ids.size:
            if isinstance(input_ids, torch.Tensor):
                lo, hi = (int(v) for v in torch.aminmax(input_ids))  # one pass
            else:
                lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.raw_vocab_size:
                arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
                bad = (arr < 0) | (arr >= self.raw_vocab_size)
                pos = _first_bad(bad)
                raise HashInputError(
                    f"token id {int(arr[pos])} at position {pos} is outside [0, {self.raw_vocab_size}) for this "
                    f"tokenizer ({getattr(self.compressed_tokenizer.tokenizer_file, 'name', 'in memory')}); "
                    + ("negative ids are not allowed: pad with the pad id instead" if arr[pos] < 0
                       else "was the text tokenized with a different tokenizer?")
                )

    def hash_tensor(self, input_ids: torch.Tensor, offsets: bool = False) -> torch.Tensor:
        """Hash a validated int tensor `[B, T]` -> int64 `[L, B, T, (N-1)*K]` (ablation modes applied).

        `offsets=True`: rows of each layer's concatenated table (each head's offset added), else per-head rows.
        """
        if self.hash_mode == "constant":
            L, H = len(self.layer_ids), (self.max_ngram_size - 1) * self.n_head_per_ngram
            out = torch.zeros(L, *input_ids.shape, H, dtype=torch.int64, device=input_ids.device)
        elif self.hash_mode == "shuffled":
            out = self._shuffle(self._hash_ngram(input_ids)[0])
        else:
            out, added = self._hash_ngram(input_ids, offsets)
            offsets = offsets and not added
        if offsets:
            out = out + self._offset_tensor(out.device).view(len(self.layer_ids), 1, 1, -1)
        return out

    def _offset_tensor(self, device) -> torch.Tensor:
        """(L, H) int64: every layer's head offsets."""
        key = ("offsets", str(device))
        if key not in self._device_cache:
            self._device_cache[key] = torch.tensor([self.head_offsets(l) for l in self.layer_ids], device=device)
        return self._device_cache[key]

    def _shuffle(self, rows: torch.Tensor) -> torch.Tensor:
        """Ablation: re-key every lookup by a fixed random key of its position (no n-gram identity)."""
        L, B, T, H = rows.shape
        g = torch.Generator().manual_seed(self.seed + 12345)
        key = torch.randint(0, 1 << 40, (T, H), generator=g).to(rows.device)  # (T, H)
        primes = torch.tensor([self.head_sizes(l) for l in self.layer_ids], device=rows.device).view(L, 1, 1, H)
        return torch.remainder(rows + key, primes)

    def _hash_ngram(self, input_ids: torch.Tensor, offsets: bool = False) -> tuple[torch.Tensor, bool]:
        """Hash a validated int tensor `[B, T]` -> (int64 `[L, B, T, (N-1)*K]`, whether offsets were added),
        all layers at once.

        CPU tensors use the fused numba kernel when numba is installed (`pip install engram-torch[fast]`);
        it adds the head offsets itself when asked (`offsets`). Otherwise (and on GPU) a vectorized
        torch path computes the same per-head integers.
        """
        if input_ids.device.type == "cpu" and self.backend in ("auto", "numba"):
            if not _fasthash.available():
                if self.backend == "numba":
                    raise ImportError("backend='numba' needs numba: pip install 'engram-torch[fast]'")
            elif self.max_prime <= _fasthash.MAX_PRIME:  # larger heads need torch's int64 remainder
                return self._hash_numba(input_ids, offsets), offsets
        with self._lock:  # the torch path reuses a workspace; serialize concurrent callers (e.g. prefetch threads)
            return self._hash_torch(input_ids), False

    def _numba_constants(self) -> tuple:
        """(multipliers (L, N), kernel constants, (L, O, H), head offsets (L, O, H) float64), built once."""
        if ("numba",) not in self._device_cache:
            P = np.array([self.vocab_size_across_layers[l] for l in self.layer_ids], dtype=np.int64)
            mult = np.stack([self.layer_multipliers[l] for l in self.layer_ids]).astype(np.int64)
            off = np.array([self.head_offsets(l) for l in self.layer_ids], dtype=np.float64).reshape(P.shape)
            self._device_cache[("numba",)] = (mult, _fasthash.kernel_constants(P), P.shape, off)
        return self._device_cache[("numba",)]

    def _hash_numba(self, input_ids: torch.Tensor, offsets: bool = False) -> torch.Tensor:
        mult, consts, (L, O, H), off = self._numba_constants()
        B, T = input_ids.shape
        raw = input_ids.numpy()
        x = raw if isinstance(self.compressed_tokenizer, RawIds) else self.compressed_tokenizer.lookup_table[raw]
        out = np.empty((L, B, T, O * H), dtype=np.int64)
        _fasthash.hash_into(x, self.pad_id, mult, consts, out, self.reset_id, off if offsets else None)
        return torch.from_numpy(out)

    def _hash_torch(self, input_ids: torch.Tensor) -> torch.Tensor:
        lut, mult, primes, p64, c64 = self._tensors(input_ids.device)
        L, O, H = primes.shape
        B, T = input_ids.shape
        N = self.max_ngram_size
        x = lut[input_ids.long()].reshape(1, B * T)  # (1, BT) compressed
        if self.reset_id is None:
            padded = torch.nn.functional.pad(x.view(B, T), (N - 1, 0), value=self.pad_id)
            shifts = [padded[:, N - 1 - k: N - 1 - k + T].reshape(B * T) for k in range(N)]
        else:  # n-grams do not reach across a document boundary (an EOS): those positions read the pad id
            xs = x.view(B, T)
            pos = torch.arange(T, device=x.device)
            since = pos - torch.from_numpy(document_starts(input_ids.cpu().numpy(), self.reset_id)).to(x.device)
            shifts = [x.reshape(B * T)] + [
                torch.where(since >= k, xs[:, (pos - k).clamp_min(0)], self.pad_id).reshape(B * T) for k in range(1, N)]
        mixes = torch.empty(L, O, 1, B * T, dtype=torch.int64, device=x.device)  # (L, O, 1, BT)
        for li in range(L):
            mix = shifts[0] * mult[li, 0]
            for k in range(1, N):
                mix = torch.bitwise_xor(mix, shifts[k] * mult[li, k])
                mixes[li, k - 1, 0] = mix
        # Heads-outer layout keeps every kernel contiguous along BT; one transposing copy at the end.
        # Intermediates live in a reused workspace: fresh 8 MB buffers cost more in page faults than the math.
        ws_key = ("ws", str(x.device), B * T)
        if ws_key not in self._device_cache:
            self._device_cache = {k: v for k, v in self._device_cache.items() if k[0] != "ws"}
            f64 = dict(dtype=torch.float64, device=x.device)
            self._device_cache[ws_key] = (torch.empty(L, O, 1, B * T, **f64), torch.empty(L, O, 1, B * T, **f64),
                                          torch.empty(L, O, H, B * T, **f64), torch.empty(L, O, H, B * T, **f64))
        hi, lo, r, q = self._device_cache[ws_key]
        if self.max_prime <= (1 << 26):
            hi.copy_(mixes >> 32)
            lo.copy_(mixes & 0xFFFFFFFF)
            if self.max_prime > (1 << 21):
                hi = torch.remainder(hi, p64)  # reduce first so hi * c stays below 2^53
            torch.addcmul(lo, hi, c64, out=r)  # (L, O, H, BT): hi * (2^32 mod p) + lo, exact
            torch.div(r, p64, out=q).floor_()  # exact: correctly rounded a/b floors right for |a| < 2^53
            r.addcmul_(q, p64, value=-1)
        else:
            r = torch.remainder(mixes, primes.view(L, O, H, 1))
        out = torch.empty(L, B * T, O * H, dtype=torch.int64, device=x.device)
        out.copy_(r.view(L, O * H, B * T).transpose(1, 2))
        return out.view(L, B, T, O * H)

    def hash(self, input_ids, offsets: bool = False) -> dict:
        """Row indices of every head: `{layer_id: [B, T, (N-1)*K] int64}`.

        Accepts a numpy array (returns numpy, like the reference) or a torch tensor on any
        device (returns torch on the same device). Indices are per head (no offsets added), or with
        `offsets=True` rows of the layer's concatenated table (`head_offsets` added: what a table
        gathers, and what transformers' `Qwen4ExpTextNGramEmbedding` computes), in the same pass.
        """
        self.validate(input_ids)
        as_numpy = not isinstance(input_ids, torch.Tensor)
        t = torch.from_numpy(np.ascontiguousarray(input_ids)) if as_numpy else input_ids
        out = self.hash_tensor(t, offsets)
        if as_numpy:
            out = out.numpy()
        return {layer_id: out[i] for i, layer_id in enumerate(self.layer_ids)}

    def hash_continuation(self, input_ids: torch.Tensor, history: torch.Tensor | None = None,
                          offsets: bool = False) -> dict:
        """Hash ids of new tokens whose n-grams reach back into earlier ones: `{layer_id: (B, T, H)}`.

        `history` (B, <= N-1) holds the ids before `input_ids` (B, T) (decoding with a KV cache:
        `model.EngramCache` keeps them); the result covers the T new positions only. `offsets` as in `hash`.
        """
        if history is None or history.shape[1] == 0:
            return self.hash(input_ids, offsets)
        T = input_ids.shape[1]
        full = self.hash(torch.cat([history.to(input_ids.device), input_ids], dim=1), offsets)
        return {k: v[:, -T:] for k, v in full.items()}

    # ------------------------------------------------------------------ manifest
    def spec(self, include_lookup_table: bool = True) -> dict:
        """The family's self-describing manifest: everything another runtime needs to hash identically."""
        return self.family.spec(include_lookup_table)

    def spec_identity(self) -> dict:
        """What decides which row an n-gram reads (`hashing.spec_identity` of this mapping's manifest)."""
        return spec_identity(self.spec(include_lookup_table=False))

    def spec_digest(self) -> str:
        """sha256 of `spec_identity()` (what overlays record)."""
        return identity_digest(self.spec(include_lookup_table=False))

    def check_spec(self, spec: dict, what: str = "hash manifest", error: type[Exception] = ConfigError) -> None:
        """Refuse a manifest that hashes differently from this mapping (family, lookup table, pad, layers)."""
        check_identity(self.spec(include_lookup_table=False), spec, what, error)

    def save_spec(self, path, include_lookup_table: bool = True) -> None:
        atomic_write_bytes(Path(path), (json.dumps(self.spec(include_lookup_table), indent=1) + "\n").encode("utf-8"))

    @classmethod
    def from_spec(cls, spec_or_path, tokenizer_name_or_path=None) -> "NgramHashMapping":
        """Build a mapping from an `engram spec` manifest of any family, refusing a tokenizer that does not match it."""
        if isinstance(spec_or_path, (str, os.PathLike)):
            spec = read_json(spec_or_path, "hash spec", f"write one with `engram spec --out {spec_or_path}`", ConfigError)
        else:
            spec = spec_or_path
        if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT:
            raise ConfigError(f"not an Engram hash spec (expected format {SPEC_FORMAT!r})")
        family = family_class(spec.get("family", "deepseek")).from_spec(spec, tokenizer_name_or_path)
        m = (family.mapping_class or cls).for_family(family)
        m.check_spec(spec, "hash spec")
        return m


_MAPPING_CACHE: dict[str, NgramHashMapping] = {}


def get_hash_mapping(cfg: EngramConfig) -> NgramHashMapping:
    """One shared `NgramHashMapping` per hashing-relevant config (building one costs a tokenizer load)."""
    key = json.dumps([cfg.tokenizer_name_or_path, cfg.engram_vocab_size, cfg.max_ngram_size, cfg.n_embed_per_ngram,
                      cfg.n_head_per_ngram, cfg.layer_ids, cfg.pad_id, cfg.seed, cfg.compress_tokenizer, cfg.hash_mode])
    if key not in _MAPPING_CACHE:
        _MAPPING_CACHE[key] = NgramHashMapping.from_config(cfg)
    return _MAPPING_CACHE[key]
