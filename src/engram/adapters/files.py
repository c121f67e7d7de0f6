"""A base model and an adapter read from their folders without building a transformers model: what an engine that
builds its own modules (vLLM's workers, `integrations.vllm.adapter_model`) needs, each piece equal to what
`load_adapter` computes on the loaded pair (tested):

- `adapter_mapping`: the adapter's `EngramConfig` and hashing, its tokenizer and hash manifest checked;
- `base_fingerprint_from_files`: `introspect.base_fingerprint` from a base's config and safetensors files;
- `check_base`: the base refused, in `load_adapter`'s words, when it is not the adapter's;
- `adapted_digest`: `model_digest` of the base with the adapter loaded (what overlays are checked against).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, EngramConfig
from ..hashing import SPEC_FILE, NgramHashMapping
from ..persist import read_json, sha256_bytes
from .introspect import TOKENIZER_FILE, AdapterError, _digest, _fingerprint_mismatch, _sample_ids, compressed_tokenizer
from .saving import ADAPTER_PREFIX, adapter_tensors

# where the supported bases keep their input embedding in their safetensors files
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight",
                   "gpt_neox.embed_in.weight")


def adapter_mapping(d: Path, meta: dict) -> tuple[EngramConfig, NgramHashMapping]:
    """(EngramConfig, hashing) of adapter folder `d` (`meta`: its `engram_adapter.json`), as `load_adapter` builds
    them: hashing with the adapter's own `tokenizer.json`, checked against the saved vocabulary and hash manifest."""
    d = Path(d)
    ct = compressed_tokenizer(d / TOKENIZER_FILE)
    if ct.lookup_sha256 != meta["base"]["vocab"]["lookup_sha256"]:
        raise AdapterError(f"{d}: its {TOKENIZER_FILE} is not the tokenizer it was trained with (its compression "
                           "differs); save the adapter again")
    try:
        cfg = EngramConfig(**{**meta["engram"], "tokenizer_name_or_path": TOKENIZER_FILE})
        mapping = NgramHashMapping.from_config(cfg, compressed_tokenizer=ct)
    except (ConfigError, TypeError) as e:
        raise AdapterError(f"{d}: Engram options: {str(e).splitlines()[0]}") from None
    spec = read_json(d / SPEC_FILE, "hash manifest", "save the adapter again", AdapterError)
    mapping.check_spec(spec, str(d), AdapterError)
    return cfg, mapping


def safetensors_files(base: Path) -> list[Path]:
    """The base's weight files: those its index names, else every `*.safetensors` in the folder."""
    base = Path(base)
    index = base / "model.safetensors.index.json"
    if index.is_file():
        wmap = read_json(index, "weights index", "save the base again", AdapterError).get("weight_map", {})
        names = sorted(set(wmap.values()))
        return [base / n for n in names]
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"{base}: no safetensors weights (save the base with save_pretrained, safetensors on)")
    return files


def base_fingerprint_from_files(base: Path, ct) -> dict:
    """`introspect.base_fingerprint` of the base saved in folder `base` (config by `AutoConfig`, the 256 sampled
    embedding rows read from its safetensors files), without loading the model."""
    from safetensors import safe_open
    from transformers import AutoConfig

    base = Path(base)
    try:
        cfg = AutoConfig.from_pretrained(str(base)).to_dict()
    except (ValueError, OSError) as e:
        raise AdapterError(f"{base}: could not read the model config: {str(e).splitlines()[0]}") from None
    from .introspect import _FINGERPRINT_KEYS

    for f in safetensors_files(base):
        with safe_open(str(f), "pt") as sf:
            name = next((n for n in EMBEDDING_NAMES if n in sf.keys()), None)
            if name is None:
                continue
            sl = sf.get_slice(name)
            shape = list(sl.get_shape())
            idx = torch.linspace(0, shape[0] - 1, min(256, shape[0])).round().long().tolist()
            sample = torch.cat([sl[i:i + 1] for i in idx]).to(torch.bfloat16).float().contiguous()
            return {"config": {k: cfg[k] for k in _FINGERPRINT_KEYS if k in cfg},
                    "vocab": {"size": ct.vocab_size, "lookup_sha256": ct.lookup_sha256},
                    "embedding": {"shape": shape, "sample_sha256": sha256_bytes(sample.numpy().tobytes())}}
    raise AdapterError(f"{base}: no input embedding in its weights (looked for {', '.join(EMBEDDING_NAMES)})")


def check_base(base: Path, adapter: Path, meta: dict) -> None:
    """Refuse a base that is not the one adapter `adapter` was saved for, with `load_adapter`'s message."""
    ct = compressed_tokenizer(Path(adapter) / TOKENIZER_FILE)
    why = _fingerprint_mismatch(meta["base"], base_fingerprint_from_files(base, ct))
    if why:
        raise AdapterError(f"{adapter} was saved for another base model: {why}")


def adapted_digest(base: Path, adapter: Path, meta: dict) -> str:
    """`model_digest` of base folder `base` with adapter `adapter` loaded (`load_adapter`), read from their files:
    the base's dense weights (the base modules saved with the adapter in their place, a tied head under both
    names), the adapter's dense weights under `engram_adapter.`, and the sampled rows of each adapter table."""
    from safetensors import safe_open

    from ..memory import is_table_key

    dense = {}
    for f in safetensors_files(base):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if torch.is_floating_point(t):
                    dense[name] = t
    sd, base_sd, _ = adapter_tensors(adapter, meta)
    dense.update({k: v for k, v in base_sd.items() if torch.is_floating_point(v)})
    cfg = read_json(Path(base) / "config.json", "model config", "save the base again", AdapterError)
    emb = next((n for n in EMBEDDING_NAMES if n in dense), None)
    if cfg.get("tie_word_embeddings") and emb is not None:
        dense["lm_head.weight"] = dense[emb]  # (saved once; the loaded model has both names)
    tables = {}
    for name, t in sd.items():
        if is_table_key(name):  # "layers.{i}.multi_head_embedding.embedding.weight"
            lid = int(name.split("layers.", 1)[1].split(".", 1)[0])
            tables[lid] = (t.shape[0], t.shape[1], t.index_select(0, _sample_ids(t.shape[0])))
        elif torch.is_floating_point(t):
            dense[ADAPTER_PREFIX + name] = t
    return _digest(dense.items(), tables)
