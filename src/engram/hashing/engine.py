"""The hashing engine: token ids -> per-head row indices into the Engram tables, for every hash family.

Over 450 lines on purpose: `NgramHashMapping` is one class whose paths (numba, torch, a family's own mix, a serving
step's windows and kernel plan) share its constants and caches; split apart they would reach into each other's
private state.

For every Engram layer, n-gram order n = 2..N and head k, position t gets

    mix_n(t) = (x_t * m_0) XOR (x_{t-1} * m_1) XOR ... XOR (x_{t-n+1} * m_{n-1})   (wrapping int64)
    row      = mix_n(t) mod p_{n,k}                                              (floor modulo)

over (compressed) ids x (constants from the family: `families.py`). An n-gram never reaches back past
its document's start: positions before the sequence, before the token after a `reset_id` (EOS), and at
or before a DEAD position (`hash(..., dead=mask)`: an image span, say) read the pad id instead. All three
are one mechanism: a per-position "a document ends here" mask (`_ends`), with a DEAD position's own
id read as the pad. A family whose reset id also reads the pad at its own position (`reset_reads_pad`:
vLLM's LongCat negates EOS ids, so an EOS is an empty n-gram) has its resets folded into the DEAD mask.

A family with another mix than the XOR one (`HashFamily.mix_rows`: LongCat's sums of powers of the
vocabulary) gets the same per-position windows (pads and resets applied) and mixes them itself.

Bit-identical to the reference `NgramHashMapping` (checked against `golden/hash_default.json` in the tests).

Speed: the reference spends most of its time in one int64 modulo per head. We split each
mix into a signed high and an unsigned low 32-bit half, `mix = hi * 2^32 + lo`, so that
`mix mod p = ((hi mod p) * (2^32 mod p) + lo) mod p`; for p <= 2^26 the bracket is an integer
below 2^53, exact in float64, and float64 floor-divisions (corrected by one p where rounding
lands on the wrong side) finish the job: that is the torch path (GPU, or CPU without numba).
On CPU a fused numba kernel (`engram-torch[fast]`, `kernels.py`) does all heads of all layers in
one parallel pass with a three-way split, `mix = hi * 2^48 + mid * 2^32 + lo`, that needs a
single floor-division per head, SIMD across tokens, optionally adding the head offsets
(`hash(..., offsets=True)`); it is exact for p <= 2^36. Larger primes fall back to int64
`torch.remainder`. A serving step hashes each token after its own window (`hash_windows`), or hands a fused kernel
the mapping's constants (`kernel_plan`: `integrations.vllm._kernels.hash_step` reads the ids from vLLM's per-slot
store).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..config import ConfigError, EngramConfig
from ..deprecation import renamed_keywords
from ..errors import install_hint
from ..persist import atomic_write_bytes, read_json
from ..tokenizer import CompressedTokenizer, RawIds
from . import kernels
from .families import DeepSeekFamily, HashFamily, family_class
from .identity import SPEC_FORMAT, check_identity, identity_digest, spec_identity
from .inputs import HashInputError, dead_mask, validate_ids

KERNELS = ("auto", "numba", "torch")  # `NgramHashMapping(kernel=)`: what hashes on the CPU

def _from_family(attr: str, doc: str = ""):
    return property(lambda self: getattr(self.family, attr), doc=doc or f"The family's `{attr}`.")


class HashPlan(NamedTuple):
    """A mapping's hash as a fused CPU kernel computes it (`NgramHashMapping.kernel_plan`)."""

    layer_ids: list
    lut: np.ndarray  # (V,) int64: raw id -> compressed id; empty: the raw ids themselves
    pad: int  # the compressed pad id, read before the sequence
    vocab: int  # raw ids lie in [0, vocab)
    mult: np.ndarray  # (L, N) int64 multipliers
    consts: tuple  # (p, 2^32 mod p, 2^48 mod p, 1/p), each (L, N-1, H) float64 (`kernels.kernel_constants`)
    offsets: np.ndarray  # (L, N-1, H) float64 added to each head's row (zeros: per-head rows)
    heads: int  # (N-1) * H: rows per token per layer
    dtype: np.dtype  # the family's index dtype
    validate: Callable  # raises `HashInputError` naming a bad id


class NgramHashMapping:
    """The hashing engine: validates ids, dispatches to the fused kernel or the torch path, for any family.

    `NgramHashMapping(engram_vocab_size, ..., seed)` keeps the reference's constructor and attributes
    (`layer_multipliers`, `vocab_size_across_layers`, `compressed_tokenizer`, `pad_id` (= `compressed_pad_id`),
    `tokenizer_vocab_size` (= `compressed_vocab_size`)) and hashes the `DeepSeekFamily`;
    `NgramHashMapping.for_family(f)` any other (each integration's `hash_mapping(config, ...)` builds its family
    and returns this engine over it).

        m = NgramHashMapping.for_family(family)
        rows = m.hash(ids, offsets=True, dead=None)            # {layer_id: (B, T, H)} rows of the layer's table
        rows = m.hash_continuation(new, history, offsets=True)  # the rows of `new` (B, T) after `history` (B, S)

    `kernel`: what hashes on the CPU: "auto" (the fused numba kernel where it applies, else torch), "numba" (the
    kernel, or an ImportError without numba) or "torch" (`backend=`: its deprecated spelling). On an accelerator
    it is always torch.
    """

    @renamed_keywords(backend="kernel")
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
        kernel: str = "auto",
        compress: bool = True,
        hash_mode: str = "ngram",
    ):
        family = DeepSeekFamily(engram_vocab_size, max_ngram_size, n_embed_per_ngram, n_head_per_ngram, layer_ids,
                                tokenizer_name_or_path, pad_id, seed, compressed_tokenizer=compressed_tokenizer,
                                compress=compress, hash_mode=hash_mode)
        self._bind(family, kernel)

    def _bind(self, family: HashFamily, kernel: str) -> None:
        if kernel not in KERNELS:
            raise ConfigError(f"kernel must be 'auto', 'numba' or 'torch', got {kernel!r}")
        self.family, self.kernel = family, kernel
        self.max_prime = family.max_prime
        self._np_index_dtype = torch.empty(0, dtype=family.index_dtype, device="cpu").numpy().dtype  # (meta ctx)
        self._device_cache: dict[Any, tuple] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """`copy.deepcopy` and pickle: the family and kernel; the lock and the per-device cache are rebuilt."""
        return {"family": self.family, "kernel": self.kernel}

    def __setstate__(self, state: dict) -> None:
        self._bind(state["family"], state.get("kernel", state.get("backend")))  # ("backend": its old name)

    @property
    def backend(self) -> str:
        """The deprecated name of `kernel`."""
        warnings.warn("NgramHashMapping.backend is deprecated; use .kernel", DeprecationWarning, stacklevel=2)
        return self.kernel

    @backend.setter
    def backend(self, kernel: str) -> None:
        warnings.warn("NgramHashMapping.backend is deprecated; use .kernel", DeprecationWarning, stacklevel=2)
        self.kernel = kernel

    @classmethod
    @renamed_keywords(backend="kernel")
    def for_family(cls, family: HashFamily, kernel: str = "auto") -> "NgramHashMapping":
        """The engine over any `HashFamily`, hashing with `kernel` (as `NgramHashMapping(..., kernel=)`)."""
        self = cls.__new__(cls)
        self._bind(family, kernel)
        return self

    @classmethod
    def from_config(cls, cfg: EngramConfig, compressed_tokenizer: CompressedTokenizer | None = None
                    ) -> "NgramHashMapping":
        return cls.for_family(DeepSeekFamily.from_config(cfg, compressed_tokenizer))

    # The family's constants, each under the one name the family gives it (the reference's where it has one).
    # Aliases, documented and kept for the reference's API: `pad_id` (= compressed_pad_id: the pad's x, not
    # EngramConfig.pad_id, the token id) and `tokenizer_vocab_size` (= compressed_vocab_size); `tokenizer_len`
    # (= raw_vocab_size) is deprecated. engram's own code reads the kept names.
    layer_ids = _from_family("layer_ids")
    max_ngram_size = _from_family("max_ngram_size")
    n_head_per_ngram = _from_family("n_head_per_ngram")
    n_embed_per_ngram = property(lambda self: getattr(self.family, "n_embed_per_ngram", None))
    vocab_size_per_ngram = property(lambda self: getattr(self.family, "vocab_size_per_ngram", None))
    seed = _from_family("seed")
    compressed_tokenizer = _from_family("compressed_tokenizer")
    compress = property(lambda self: getattr(self.family, "compress", False))
    hash_mode = _from_family("hash_mode")
    compressed_pad_id = _from_family("compressed_pad_id", "The pad's compressed id x (what positions before the "
                                     "start read; `raw_pad_id` is its token id).")
    raw_pad_id = _from_family("raw_pad_id", "The pad's token id (`EngramConfig.pad_id`).")
    reset_id = _from_family("reset_id")
    index_dtype = _from_family("index_dtype", "dtype of the row ids `hash` returns (int64; int32 for some families).")
    layer_multipliers = _from_family("layer_multipliers", "`{layer_id: int64 [max_ngram_size]}`.")
    vocab_size_across_layers = _from_family("vocab_size_across_layers", "`{layer_id: [[p] * heads] * orders}`: the "
                                            "head moduli.")
    raw_vocab_size = _from_family("raw_vocab_size", "Token ids accepted: [0, raw_vocab_size).")
    compressed_vocab_size = _from_family("compressed_vocab_size", "Distinct compressed ids.")
    tokenizer_vocab_size = property(lambda self: self.family.compressed_vocab_size,
                                    doc="The reference's name of `compressed_vocab_size` (an alias).")
    pad_id = property(lambda self: self.family.compressed_pad_id,
                      doc="The reference's name of `compressed_pad_id` (an alias: the reference's code reads it; "
                          "not `EngramConfig.pad_id`, the token id, which is `raw_pad_id`).")

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
            lut = self._lut(device)
            mult = torch.tensor(np.stack([self.layer_multipliers[l] for l in self.layer_ids]), device=device)
            primes = torch.tensor([self.vocab_size_across_layers[lid] for lid in self.layer_ids], device=device)
            L, O, H = primes.shape
            p64 = primes.to(torch.float64).view(L, O, H, 1)
            c64 = torch.remainder(torch.full_like(primes, 1 << 32), primes).to(torch.float64).view(L, O, H, 1)
            self._device_cache[key] = (lut, mult, primes, p64, c64)
        return self._device_cache[key]

    def validate(self, input_ids) -> None:
        """Raise `HashInputError` unless `input_ids` is a 2-D integer array of ids in [0, len(tokenizer))."""
        validate_ids(input_ids, self.raw_vocab_size, self.compressed_tokenizer)

    def _ends(self, raw: np.ndarray, dead: np.ndarray | None) -> np.ndarray | None:
        """(B, T) bool: True where a document ends (n-grams after it read the pad from there back), or None.

        A document ends at each `reset_id` (EOS), and just before and at each DEAD position (whose own id is
        read as the pad): EOS resets and DEAD masks are one mechanism, per-position resets.
        """
        reset = self.family.reset_id
        ends = None if reset is None else raw == reset
        if dead is not None:
            d = dead.copy()
            d[:, :-1] |= dead[:, 1:]  # before and at each DEAD position
            ends = d if ends is None else ends | d
        return ends

    def hash_tensor(self, input_ids: torch.Tensor, offsets: bool = False, dead: np.ndarray | None = None
                    ) -> torch.Tensor:
        """Hash a validated int tensor `[B, T]` -> `index_dtype` `[L, B, T, (N-1)*K]` (ablation modes applied).

        `offsets=True`: rows of each layer's concatenated table (each head's offset added), else per-head rows.
        `dead`: a checked (B, T) numpy bool mask of DEAD positions (`_dead`), or None.
        """
        if self.hash_mode == "constant":
            L, H = len(self.layer_ids), (self.max_ngram_size - 1) * self.n_head_per_ngram
            out = torch.zeros(L, *input_ids.shape, H, dtype=torch.int64, device=input_ids.device)
        elif self.hash_mode == "shuffled":
            out = self._shuffle(self._hash_ngram(input_ids, dead=dead)[0])
        else:
            out, added = self._hash_ngram(input_ids, offsets, dead)
            offsets = offsets and not added
        if offsets:
            out = out + self._offset_tensor(out.device).view(len(self.layer_ids), 1, 1, -1)
        dtype = self.family.index_dtype
        return out if out.dtype == dtype else out.to(dtype)

    def _offset_tensor(self, device) -> torch.Tensor:
        """(L, H) int64: every layer's head offsets."""
        key = ("offsets", str(device))
        if key not in self._device_cache:
            self._device_cache[key] = torch.tensor([self.head_offsets(lid) for lid in self.layer_ids], device=device)
        return self._device_cache[key]

    def _shuffle(self, rows: torch.Tensor) -> torch.Tensor:
        """Ablation: re-key every lookup by a fixed random key of its position (no n-gram identity)."""
        L, B, T, H = rows.shape
        g = torch.Generator().manual_seed(self.seed + 12345)
        key = torch.randint(0, 1 << 40, (T, H), generator=g).to(rows.device)  # (T, H)
        primes = torch.tensor([self.head_sizes(lid) for lid in self.layer_ids], device=rows.device).view(L, 1, 1, H)
        return torch.remainder(rows + key, primes)

    def _hash_ngram(self, input_ids: torch.Tensor, offsets: bool = False, dead: np.ndarray | None = None
                    ) -> tuple[torch.Tensor, bool]:
        """Hash a validated int tensor `[B, T]` -> (`[L, B, T, (N-1)*K]`, whether offsets were added),
        all layers at once.

        CPU tensors use the fused numba kernel when numba is installed (the `fast` extra);
        it adds the head offsets itself when asked (`offsets`) and writes `index_dtype`. Otherwise (and on
        GPU) a vectorized torch path computes the same per-head integers (int64).
        """
        cpu = input_ids.device.type == "cpu"
        raw = input_ids.numpy() if cpu else None
        ends = None
        if self.family.reset_id is not None or dead is not None:  # (found on the host)
            host = raw if cpu else input_ids.cpu().numpy()  # (one copy off the device)
            if self.family.reset_id is not None and self.family.reset_reads_pad:  # a reset is a DEAD position
                resets = host == self.family.reset_id
                dead = resets if dead is None else dead | resets
            ends = self._ends(host, dead)
        if self.family.own_mix:  # the family mixes the windows itself (no fused kernel)
            B, T = input_ids.shape
            rows = self.family.mix_rows(self._windows(input_ids, ends, dead))  # (L, B*T, H)
            return rows.view(len(self.layer_ids), B, T, -1), False
        if cpu and self.kernel in ("auto", "numba"):
            if not kernels.available():
                if self.kernel == "numba":
                    raise ImportError(f"kernel='numba' needs numba: {install_hint('fast')}")
            elif self.max_prime <= kernels.MAX_PRIME:  # larger heads need torch's int64 remainder
                return self._hash_numba(raw, offsets, ends, dead), offsets
        with self._lock:  # the torch path reuses a workspace; serialize concurrent callers (e.g. prefetch threads)
            return self._hash_torch(input_ids, ends, dead), False

    def _numba_constants(self) -> tuple:
        """(multipliers (L, N), kernel constants, (L, O, H), head offsets (L, O, H) float64), built once."""
        if ("numba",) not in self._device_cache:
            P = np.array([self.vocab_size_across_layers[lid] for lid in self.layer_ids], dtype=np.int64)
            mult = np.stack([self.layer_multipliers[lid] for lid in self.layer_ids]).astype(np.int64)
            off = np.array([self.head_offsets(lid) for lid in self.layer_ids], dtype=np.float64).reshape(P.shape)
            self._device_cache[("numba",)] = (mult, kernels.kernel_constants(P), P.shape, off)
        return self._device_cache[("numba",)]

    def _hash_numba(self, raw: np.ndarray, offsets: bool, ends: np.ndarray | None,
                    dead: np.ndarray | None) -> torch.Tensor:
        """The fused kernel over the ids `raw` (B, T) (numpy view of a CPU tensor)."""
        mult, consts, (L, O, H), off = self._numba_constants()
        B, T = raw.shape
        x = raw if isinstance(self.compressed_tokenizer, RawIds) else self.compressed_tokenizer.lookup_table[raw]
        if dead is not None:
            x = np.where(dead, self.compressed_pad_id, x)  # a DEAD position's own id reads the pad
        out = np.empty((L, B, T, O * H), dtype=self._np_index_dtype)
        kernels.hash_into(x, self.compressed_pad_id, mult, consts, out, ends, off if offsets else None)
        return torch.from_numpy(out)

    def _windows(self, input_ids: torch.Tensor, ends: np.ndarray | None, dead: np.ndarray | None
                 ) -> list[torch.Tensor]:
        """N tensors (B*T,) int64: [k] holds x_{t-k} at every position t, or the pad where that position lies
        before the sequence, before its document's start or at a DEAD position."""
        lut = self._lut(input_ids.device)
        B, T = input_ids.shape
        N = self.max_ngram_size
        x, pad = lut[input_ids.long()], self.compressed_pad_id  # (B, T) compressed; the pad's x
        if dead is not None:
            x = torch.where(torch.from_numpy(dead).to(x.device), pad, x)  # a DEAD position's own id: the pad
        if ends is None:
            padded = torch.nn.functional.pad(x, (N - 1, 0), value=pad)
            return [padded[:, N - 1 - k: N - 1 - k + T].reshape(B * T) for k in range(N)]
        # n-grams do not reach back past their document's start: those positions read the pad id
        pos = torch.arange(T, device=x.device)
        last = torch.where(torch.from_numpy(ends).to(x.device), pos, -1).cummax(dim=1).values  # last end <= t
        since = pos - torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1) - 1  # (B, T): tokens since the start
        return [x.reshape(B * T)] + [
            torch.where(since >= k, x[:, (pos - k).clamp_min(0)], pad).reshape(B * T) for k in range(1, N)]

    def _lut(self, device: torch.device) -> torch.Tensor:
        key = ("lut", str(device))
        if key not in self._device_cache:
            self._device_cache[key] = torch.from_numpy(self.compressed_tokenizer.lookup_table).to(device)
        return self._device_cache[key]

    def _hash_torch(self, input_ids: torch.Tensor, ends: np.ndarray | None, dead: np.ndarray | None
                    ) -> torch.Tensor:
        _, mult, primes, p64, c64 = self._tensors(input_ids.device)
        L, O, H = primes.shape
        B, T = input_ids.shape
        N = self.max_ngram_size
        shifts = self._windows(input_ids, ends, dead)
        dev = input_ids.device
        mixes = torch.empty(L, O, 1, B * T, dtype=torch.int64, device=dev)  # (L, O, 1, BT)
        for li in range(L):
            mix = shifts[0] * mult[li, 0]
            for k in range(1, N):
                mix = torch.bitwise_xor(mix, shifts[k] * mult[li, k])
                mixes[li, k - 1, 0] = mix
        # Heads-outer layout keeps every kernel contiguous along BT; one transposing copy at the end.
        # Intermediates live in a reused workspace: fresh 8 MB buffers cost more in page faults than the math.
        ws_key = ("ws", str(dev), B * T)
        if ws_key not in self._device_cache:
            self._device_cache = {k: v for k, v in self._device_cache.items() if k[0] != "ws"}
            f64 = dict(dtype=torch.float64, device=dev)
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
        out = torch.empty(L, B * T, O * H, dtype=torch.int64, device=dev)
        out.copy_(r.view(L, O * H, B * T).transpose(1, 2))
        return out.view(L, B, T, O * H)

    def hash(self, input_ids, offsets: bool = False, dead=None) -> dict:
        """Row indices of every head: `{layer_id: [B, T, (N-1)*K]}` of the family's `index_dtype`.

        Accepts a numpy array (returns numpy, like the reference) or a torch tensor on any
        device (returns torch on the same device). Indices are per head (no offsets added), or with
        `offsets=True` rows of the layer's concatenated table (`head_offsets` added: what a table
        gathers, and what transformers' `Qwen4ExpTextNGramEmbedding` and DeepSeek-V4.1 compute), in the same
        pass. `dead` (B, T) bool: DEAD positions (an image span, say); every n-gram that reaches one reads
        the pad from there back, as before the sequence start.
        """
        self.validate(input_ids)
        as_numpy = not isinstance(input_ids, torch.Tensor)
        t = torch.from_numpy(np.ascontiguousarray(input_ids)) if as_numpy else input_ids
        out = self.hash_tensor(t, offsets, dead_mask(dead, t.shape))
        if as_numpy:
            out = out.numpy()
        return {layer_id: out[i] for i, layer_id in enumerate(self.layer_ids)}

    def hash_windows(self, windows: np.ndarray, start: np.ndarray | None = None, offsets: bool = False) -> dict:
        """Hash ids of each window's last position: `{layer_id: (M, H)}` tensors, what `hash` gives that position.

        `windows` (M, N) int64, N = `max_ngram_size`: a token's own id last, the N-1 ids before it oldest first;
        `start` (M,): each window's first position inside its sequence (0: all N are; the positions before it
        lie before the sequence, hold any valid id and read the pad), or None (0 everywhere). Equal to
        `hash(windows, offsets, dead=arange(N) < start[:, None])[:, -1]`.

        For a serving step whose tokens belong to different requests (`integrations.vllm.step`): one window per
        token, gathered from a per-slot store. Where the fused kernel applies (CPU numba, the XOR mix, no reset
        id, the normal hash mode) the windows go to it directly, without `hash`'s DEAD-mask and document-end
        bookkeeping, which a start-of-sequence prefix does not need (it reads the pad either way); elsewhere
        this is the call above.
        """
        w = np.ascontiguousarray(windows, dtype=np.int64)
        if w.ndim != 2 or w.shape[1] != self.max_ngram_size:
            raise HashInputError(f"windows must be (M, {self.max_ngram_size}) (max_ngram_size ids each), got "
                                 f"{list(w.shape)}")
        dead = None  # (M, N): the positions before each window's sequence
        if start is not None and np.any(start):
            dead = np.arange(w.shape[1]) < np.asarray(start)[:, None]
        plan = self.kernel_plan(offsets)
        if plan is None:
            return {k: v[:, -1] for k, v in self.hash(w, offsets, dead).items()}
        if w.size and (w.min() < 0 or w.max() >= self.raw_vocab_size):
            self.validate(w)  # (raises, naming the id)
        x = w.copy() if plan.lut.size == 0 else plan.lut[w]
        if dead is not None:
            x[dead] = plan.pad  # before the sequence
        out = np.empty((len(self.layer_ids), w.shape[0], w.shape[1], plan.heads), dtype=plan.dtype)  # (N is tiny)
        kernels.hash_into(x, plan.pad, plan.mult, plan.consts, out, None, plan.offsets)
        last = torch.from_numpy(out[:, :, -1].copy())  # (L, M, O*H)
        return dict(zip(self.layer_ids, last))

    def kernel_plan(self, offsets: bool = False) -> HashPlan | None:
        """What a fused CPU kernel needs to hash as this mapping does (`HashPlan`), or None where the fused kernels
        do not apply: no numba, kernel="torch", resets (EOS), another mix than the XOR one, an ablation hash mode.
        For kernels that read their ids elsewhere than `hash` takes them (a serving step's per-slot store:
        `integrations.vllm._kernels.hash_step`); the constants are built once per mapping."""
        if (self.hash_mode in ("constant", "shuffled") or self.family.reset_id is not None or self.family.own_mix
                or self.kernel not in ("auto", "numba") or self.max_prime > kernels.MAX_PRIME
                or not kernels.available()):
            return None
        key = ("plan", bool(offsets))
        if key not in self._device_cache:
            mult, consts, (L, O, H), off = self._numba_constants()
            lut = (np.zeros(0, dtype=np.int64) if isinstance(self.compressed_tokenizer, RawIds)
                   else np.ascontiguousarray(self.compressed_tokenizer.lookup_table, dtype=np.int64))
            self._device_cache[key] = HashPlan(self.layer_ids, lut, int(self.compressed_pad_id), self.raw_vocab_size,
                                               mult, consts, off if offsets else np.zeros_like(off), O * H,
                                               self._np_index_dtype, self.validate)
        return self._device_cache[key]

    def hash_continuation(self, input_ids, history=None, offsets: bool = False, dead=None, history_dead=None) -> dict:
        """Hash ids of new tokens whose n-grams reach back into earlier ones: `{layer_id: (B, T, H)}`.

        `history` (B, S) holds the ids just before `input_ids` (B, T): the last N-1 of them, or all when
        fewer exist (decoding with a KV cache, prefill in chunks: `model.EngramCache` keeps them); the
        result covers the T new positions only. `offsets` and `dead` as in `hash`; `history_dead` (B, S)
        marks DEAD history positions.
        """
        if history is None or history.shape[1] == 0:
            return self.hash(input_ids, offsets, dead)
        T = input_ids.shape[1]
        d = None
        if dead is not None or history_dead is not None:
            hd, nd = dead_mask(history_dead, history.shape, "history_dead"), dead_mask(dead, input_ids.shape)
            d = np.concatenate([np.zeros(tuple(history.shape), dtype=np.bool_) if hd is None else hd,
                                np.zeros(tuple(input_ids.shape), dtype=np.bool_) if nd is None else nd], axis=1)
        if isinstance(input_ids, torch.Tensor):
            ids = torch.cat([torch.as_tensor(history, device=input_ids.device), input_ids], dim=1)
        else:
            ids = np.concatenate([np.asarray(history), input_ids], axis=1)
        full = self.hash(ids, offsets, d)
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
            spec = read_json(spec_or_path, "hash spec", f"write one with `engram spec --out {spec_or_path}`",
                             ConfigError)
        else:
            spec = spec_or_path
        if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT:
            raise ConfigError(f"not an Engram hash spec (expected format {SPEC_FORMAT!r})")
        family = family_class(spec.get("family", "deepseek")).from_spec(spec, tokenizer_name_or_path)
        m = cls.for_family(family)
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
