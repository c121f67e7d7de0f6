"""The hash identity: what decides which row an n-gram reads, read off a family's manifest.

Models, adapters and checkpoints save their manifest as `SPEC_FILE` and compare it with `check_identity`
on load; overlays record only its digest (`hash_spec_sha256`) and compare it with `check_digest`.

`hash_mode` is part of the identity: the "shuffled" and "constant" ablations address other rows than
"ngram" with the same constants. A manifest without the key hashes "ngram" (the families that never
write it: qwen4_exp, deepseek_v41, and manifests older than the key). The digest leaves `hash_mode` out
when it is "ngram", so an "ngram" digest is the one engram always wrote; an overlay digest written before
`hash_mode` entered the digest therefore matches every "ngram" model, and on a model of another mode it
cannot prove which mode it was made under: `check_digest` refuses it with that message.
"""

from __future__ import annotations

import hashlib
import json

from ..config import ConfigError

SPEC_FORMAT = "engram-hash-spec/1"
SPEC_FILE = "engram_hash_spec.json"  # the manifest's file name in every saved folder (models, adapters, runs)
IDENTITY_KEYS = ("family", "lookup_table_sha256", "compressed_pad_id", "layers", "hash_mode")
_DEFAULTS = {"family": "deepseek", "hash_mode": "ngram"}  # what a manifest without the key means


def spec_identity(spec: dict) -> dict:
    """What decides which row an n-gram reads, from a manifest: family, lookup table, pad, every layer's
    multipliers, primes and offsets, and the hash mode. Models, adapters and checkpoints compare exactly this."""
    if not isinstance(spec, dict):
        raise ConfigError("hash manifest is not a JSON object")
    return {k: spec.get(k, _DEFAULTS.get(k)) for k in IDENTITY_KEYS}


def _sha256(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def identity_digest(spec: dict) -> str:
    """sha256 of `spec_identity(spec)` (without `hash_mode` when it is "ngram"): what an overlay records as
    `hash_spec_sha256`."""
    ident = spec_identity(spec)
    if ident["hash_mode"] == "ngram":
        del ident["hash_mode"]
    return _sha256(ident)


def legacy_identity_digest(spec: dict) -> str:
    """The digest overlays written before 0.2 recorded (it also covered the tokenizer file's sha256, not hash_mode)."""
    return _sha256({k: spec.get(k) for k in ("family", "tokenizer_sha256", "lookup_table_sha256", "compressed_pad_id",
                                              "layers")})


def check_identity(mine: dict, saved: dict, what: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the first key where manifest `saved` (of `what`) hashes differently from `mine`."""
    a, b = spec_identity(saved), spec_identity(mine)
    if a["family"] != b["family"]:
        raise error(f"{what}: hash manifest of family {a['family']!r}, this model hashes with {b['family']!r}: the "
                    "table rows would be addressed differently; use the manifest saved with this model")
    if a["hash_mode"] != b["hash_mode"]:
        raise error(f"{what}: it was saved under hash_mode {a['hash_mode']!r}, this model hashes with "
                    f"{b['hash_mode']!r}: its Engram rows are addressed differently; load it with the config it was "
                    "saved with")
    for key in IDENTITY_KEYS[1:]:
        if a[key] != b[key]:
            raise error(f"{what}: hashing mismatch on {key!r}: it was made for other hashing constants (tokenizer, "
                        "lookup table, multipliers or primes) than this installation derives; its Engram rows would "
                        f"be garbage. Use the tokenizer and hash manifest ({SPEC_FILE}) saved with it")


def check_digest(mine: dict, digest, what: str, fix: str, error: type[Exception] = ConfigError) -> None:
    """Refuse a recorded identity digest (`hash_spec_sha256`) that does not match manifest `mine`.

    Digests recorded before `hash_mode` entered the digest (and the pre-0.2 legacy one) are accepted for an
    "ngram" model only: on another mode they cannot prove the mode they were made under. `fix` says what to do.
    """
    if digest == identity_digest(mine):
        return
    ident = spec_identity(mine)
    old = {legacy_identity_digest(mine), _sha256({k: v for k, v in ident.items() if k != "hash_mode"})}
    if digest in old and ident["hash_mode"] == "ngram":
        return
    if digest in old:
        raise error(f"{what} was saved before hash_mode was part of the hash identity, so it cannot be proven to "
                    f"match this model's hash_mode {ident['hash_mode']!r}; {fix}")
    raise error(f"{what} was made for another hash manifest (tokenizer, hash constants or hash_mode differ): its "
                f"row ids would address other n-grams; {fix}")
