"""What an adapter needs to know about a base model: where its decoder layers are, its hidden size, its
tokenizer's compression, its pad id; and the two digests that tell one model from another, both stored in
saved folders and read back as they were always computed:

- `base_fingerprint` (adapters, `engram_adapter.json` "base"): the architecture config, the vocabulary and a
  bfloat16-rounded sample of the input embedding; cheap on a large base, the same in any load dtype, and
  comparable field by field (`_fingerprint_mismatch` names what differs).
- `model_digest` (overlays, `overlay.json` "base_digest"): every dense weight in full plus a sample of each
  Engram table's rows; exact, since an overlay's rows were optimized against precisely those weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import EngramError
from ..memory import is_table_key
from ..persist import sha256_bytes
from ..tables.base import find_tables, rows_by_reference
from ..tables.overlay import OverlayTable
from ..tokenizer import CompressedTokenizer, TokenizerError

TOKENIZER_FILE = "tokenizer.json"
# where decoder families keep their layers (Llama/Qwen/Mistral/Gemma, OPT, GPT-2/GPT-J, GPT-NeoX/Pythia, Falcon, MPT)
LAYER_LISTS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "transformer.layers",
               "transformer.blocks", "model.language_model.layers")
# architecture-defining config fields compared by the base fingerprint (whichever the config has)
_FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer",
                     "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "n_inner",
                     "head_dim", "tie_word_embeddings")


class AdapterError(EngramError, ValueError):
    """An adapter cannot be attached, saved or loaded; the message names the problem and the fix."""


def default_options(hidden_size: int, vocab_size: int) -> dict:
    """Engram settings an adapter gets unless given: bigrams and trigrams, 4 heads each, rows per head ~2x
    the vocabulary (next unused primes), 64-dim head rows (n_embed_per_ngram = min(256, hidden)), the
    paper's zero-initialized conv, and rows drawn from N(0, 0.02) instead of the reference's N(0, 1): chosen by
    `engram experiment adapter-init` (docs/results/adapter-init.json) on settings kept apart from the peer
    benchmark that reports both inits (`benchmarks/bench_peers.py`): random GPT-2 and GPT-NeoX bases adapted with
    `engram adapt`'s defaults to Shakespeare and to the King James Bible, 3 seeds, paired t-test, Holm. Pass
    `table_init_std=1.0` for the reference's init."""
    e = min(256, hidden_size)
    e -= e % 4
    return dict(max_ngram_size=3, n_head_per_ngram=4, n_embed_per_ngram=max(4, e),
                engram_vocab_size=[2 * vocab_size, 2 * vocab_size], conv_zero_init=True, table_init_std=0.02)


def _get(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (attach/load go on the inner model)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def find_layers(model: nn.Module, layers_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """(dotted path, the decoder layer list) of a causal LM: `layers_path` or the first conventional one found."""
    model = _unwrap(model)
    for path in ([layers_path] if layers_path else LAYER_LISTS):
        obj = _get(model, path)
        if isinstance(obj, nn.ModuleList) and len(obj):
            return path, obj
    if layers_path:
        raise AdapterError(f"{type(model).__name__} has no layer list at {layers_path!r} (an nn.ModuleList of "
                           "decoder layers); check the name with print(model)")
    raise AdapterError(f"{type(model).__name__}: no decoder layer list found (looked for {', '.join(LAYER_LISTS)}); "
                       "pass layers_path='<dotted path of the nn.ModuleList of decoder layers>'")


def _hidden_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for k in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, k, None) if cfg is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return model.get_input_embeddings().weight.shape[1]


def compressed_tokenizer(tokenizer, model: nn.Module | None = None) -> CompressedTokenizer:
    """The compression of `tokenizer` (path, folder, tokenizer object or a `CompressedTokenizer`); None: the
    `tokenizer.json` in the folder the model was loaded from."""
    if isinstance(tokenizer, CompressedTokenizer):
        return tokenizer
    if tokenizer is None:
        src = getattr(getattr(model, "config", None), "_name_or_path", "") if model is not None else ""
        if not src or not (Path(src) / TOKENIZER_FILE).is_file():
            raise AdapterError("attach needs the base model's tokenizer: pass tokenizer=<tokenizer.json, its folder "
                               "or a fast tokenizer object> (hashing uses that tokenizer's compression)")
        tokenizer = src
    try:
        return CompressedTokenizer(tokenizer)
    except TokenizerError as e:
        raise AdapterError(str(e)) from None


def pad_or_eos_id(config) -> int | None:
    """A model config's pad token id, else its (first) EOS id, else None."""
    for v in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def generation_pad_id(model) -> int:
    """The pad id to give `generate()` and to pad batches with: `pad_or_eos_id` of the model's config, else 0."""
    pad = pad_or_eos_id(getattr(model, "config", None))
    return 0 if pad is None else pad


def _check_vocab(ct: CompressedTokenizer, model: nn.Module) -> None:
    """The tokenizer must be the model's: every id it makes has an embedding row, and the embedding is not
    much larger than the vocabulary (models pad it, e.g. Qwen3 151,669 -> 151,936)."""
    rows = model.get_input_embeddings().weight.shape[0]
    slack = max(1024, rows // 20)
    if ct.vocab_size > rows or ct.vocab_size < rows - slack:
        raise AdapterError(f"tokenizer has {ct.vocab_size:,} tokens but the model's embedding has {rows:,} rows: "
                           "this is not the model's tokenizer; pass the one it was trained with")


def base_fingerprint(model: nn.Module, ct: CompressedTokenizer) -> dict:
    """What identifies a base model: its architecture config, its vocabulary (the compression table's
    sha256) and its input embedding (shape + sha256 of 256 evenly spaced rows, rounded to bfloat16 so the
    same weights loaded in another dtype match)."""
    cfg = model.config.to_dict() if getattr(model, "config", None) is not None else {}
    emb = model.get_input_embeddings().weight.detach()
    idx = torch.linspace(0, emb.shape[0] - 1, min(256, emb.shape[0])).round().long().to(emb.device)
    sample = emb.index_select(0, idx).to(torch.bfloat16).float().cpu().contiguous()
    return {"config": {k: cfg[k] for k in _FINGERPRINT_KEYS if k in cfg},
            "vocab": {"size": ct.vocab_size, "lookup_sha256": ct.lookup_sha256},
            "embedding": {"shape": list(emb.shape), "sample_sha256": sha256_bytes(sample.numpy().tobytes())}}


def _base_rows(mhe) -> torch.Tensor:
    """The digest's sample rows (`_sample_ids`) of an Engram layer's base table (overlays bypassed), float32."""
    ids = _sample_ids(mhe.num_rows)
    base = mhe.table
    while isinstance(base, OverlayTable):
        base = base.base
    with torch.no_grad():
        return (mhe if base is None else base).lookup(ids).float()


def _sample_ids(num_rows: int) -> torch.Tensor:
    """The table rows a digest reads: 4,096 (or all) spread evenly over the table."""
    return torch.arange(0, num_rows, max(1, num_rows // 4096), dtype=torch.long)


def _digest(dense, tables) -> str:
    """sha256 over `dense` ((name, tensor) pairs, floating point, table keys left out) in name order and `tables`
    ({layer id: (rows, dim, rows at `_sample_ids(rows)` as float32)}) in layer order: the one definition
    `model_digest` and `checkpoint_digest` share."""
    h = hashlib.sha256()
    for name, t in sorted(dense, key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    for lid, (n, d, rows) in sorted(tables.items()):
        h.update(f"table{lid}:{n}x{d}".encode())
        h.update(rows.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_digest(model: nn.Module) -> str:
    """sha256 of a model's weights as an overlay depends on them: every dense weight in full, and 4,096
    rows spread over each Engram table (read through its table, so any backend gives the same digest). Take it
    before the tables are converted to another format (`inference.prepare_inference` does)."""
    with rows_by_reference():  # tables served for another framework's module: sampled below, not rebuilt in RAM
        state = model.state_dict()
    dense = [(k, t) for k, t in state.items() if not is_table_key(k) and torch.is_floating_point(t)]
    tables = {lid: (mhe.num_rows, mhe.dim, _base_rows(mhe))
              for lid, mhe in {mhe.layer_id: mhe for _, mhe in find_tables(model)}.items()}
    return _digest(dense, tables)


def checkpoint_digest(folder) -> str:
    """`model_digest` of the engram model saved in `folder` (an `EngramForCausalLM.save_pretrained` folder), read
    from its safetensors files by name without building the model: what an engine that builds its own module
    (vLLM's workers) checks overlays against. Equal to `model_digest(load_model(folder))` (tested)."""
    from safetensors import safe_open

    from ..persist import read_json

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"{folder}: no safetensors weights to digest")
    dense, tables = {}, {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                if is_table_key(name):  # "...layers.{i}.engram.multi_head_embedding.embedding.weight"
                    sl = sf.get_slice(name)
                    n, d = sl.get_shape()
                    lid = int(name.split(".layers.", 1)[1].split(".", 1)[0])
                    tables[lid] = (n, d, sf.get_tensor(name).index_select(0, _sample_ids(n)))
                    continue
                t = sf.get_tensor(name)
                if torch.is_floating_point(t):
                    dense[name] = t
    cfg = read_json(folder / "config.json", "model config", "save the model again", AdapterError) \
        if (folder / "config.json").is_file() else {}
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in dense and "model.embed_tokens.weight" in dense:
        dense["lm_head.weight"] = dense["model.embed_tokens.weight"]  # (saved once; the loaded model has both)
    return _digest(dense.items(), tables)


def _fingerprint_mismatch(saved: dict, now: dict) -> str | None:
    for k in sorted(set(saved["config"]) | set(now["config"]), key=lambda k: _FINGERPRINT_KEYS.index(k)):
        if saved["config"].get(k) != now["config"].get(k):
            return f"config {k} is {now['config'].get(k)!r}, the adapter's base had {saved['config'].get(k)!r}"
    if saved["vocab"] != now["vocab"]:
        return "its tokenizer compresses differently (another vocabulary)"
    if saved["embedding"]["shape"] != now["embedding"]["shape"]:
        return f"embedding shape {now['embedding']['shape']} != {saved['embedding']['shape']}"
    if saved["embedding"]["sample_sha256"] != now["embedding"]["sample_sha256"]:
        return "its embedding weights differ (another checkpoint of this architecture)"
    return None
