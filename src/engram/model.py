"""A real language model hosting Engram: attention (RoPE, GQA, KV cache), SwiGLU or DeepSeekMoE FFN, mHC.

Over 450 lines on purpose: the whole model (blocks, Engram placement, generation cache) is read in one sitting.

    ids (B, T) -> embed_tokens -> (B, T, G, D) streams (G = hc_mult, D = hidden) -> blocks
        -> mean over streams -> norm -> lm_head

Block (0-based index i; Engram at `engram.layer_ids`, added before attention as in the paper):
    x = x + Engram_i(x, rows_i)[0]           (B, T, G, D), gates per stream; rows_i (B, T, H, d) from the
                                             layer's table for hash ids computed outside the model
    x = HC_attn(x, lambda u: Attn(RMSNorm(u)))    (plain residual when n == 1)
    x = HC_ffn (x, lambda u: FFN(RMSNorm(u)))

Hugging Face integration: `EngramLMConfig(PretrainedConfig)`, `EngramForCausalLM(PreTrainedModel,
GenerationMixin)`, registered with the Auto classes. Needs the `hf` extra. The config lives
in `model_config.py`, the decoding state a KV cache carries in `cache.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)
from transformers import initialization as hf_init
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import EngramCache, NgramHistory, with_ngram_history  # noqa: F401  (public here too)
from .config import ConfigError
from .hashing import SPEC_FILE, get_hash_mapping
from .hyper import HyperConnection
from .memory import Engram, ShortConv
from .model_config import EngramLMConfig
from .persist import IntegrityError, read_json, recover_dir, verify_manifest, write_manifest
from .tokenizer import load_tokenizer

# transformers 5.24 renamed the KV-cache field of model outputs and generate() kwargs from `past_key_values` to
# `cache`; the supported range (>= 5.0) has either. Decided once here, never in a class body.
CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


# ---------------------------------------------------------------------------------------------- layers
def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on x (B, H, T, hd) at positions pos (T,)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[:, None] * inv[None]  # (T, hd/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: EngramLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, C = x.shape
        q = rope(self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2), pos, self.theta)  # (B, nh, T, hd)
        k = rope(self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2), pos, self.theta)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nkv, S, hd), S = past + T
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        S = k.shape[2]
        if T == S:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decoding T new tokens after S - T cached ones
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """DeepSeekMoE-style FFN: shared experts + top-k routed experts with sigmoid affinities.

    Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, used only for *selecting*
    experts, moves by `speed * sign(mean_load - load)` once per training step. Forward only counts
    the tokens routed to each expert (`tokens_per_expert`, training mode); the training step
    applies `update_bias(load)` with the load summed over data-parallel ranks.
    Dispatch: tokens are sorted by expert once and each expert runs one batched matmul.
    """

    def __init__(self, cfg: EngramLMConfig):
        super().__init__()
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.E, self.k, self.speed = E, cfg.num_experts_per_tok, cfg.moe_bias_update_speed
        self.router = nn.Linear(D, E, bias=False)
        self.register_buffer("expert_bias", torch.zeros(E))
        self.w_gate = nn.Parameter(torch.randn(E, I, D) / math.sqrt(D))
        self.w_up = nn.Parameter(torch.randn(E, I, D) / math.sqrt(D))
        self.w_down = nn.Parameter(torch.randn(E, D, I) / math.sqrt(I))
        self.shared = SwiGLU(D, cfg.shared_intermediate_size) if cfg.shared_intermediate_size else None
        self.last_load: torch.Tensor | None = None  # tokens per expert of the last forward (E,)
        self.tokens_per_expert = torch.zeros(E, dtype=torch.long)  # training forwards since the last bias update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # (N, D)
        scores = torch.sigmoid(self.router(xf))  # (N, E)
        idx = torch.topk(scores + self.expert_bias, self.k, dim=-1).indices  # (N, k), bias only selects
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)  # (N, k)
        flat = idx.flatten()  # (N*k,)
        order = torch.argsort(flat, stable=True)
        tok = order // self.k  # token of each sorted slot
        counts = torch.bincount(flat, minlength=self.E)
        xs = xf.index_select(0, tok)  # (N*k, D) grouped by expert
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):
            if c:
                seg = xs[start:start + c]
                outs.append((F.silu(seg @ self.w_gate[e].T) * (seg @ self.w_up[e].T)) @ self.w_down[e].T)
                start += c
        ys = torch.cat(outs) * w.flatten().index_select(0, order).unsqueeze(-1).to(xs.dtype)
        out = torch.zeros_like(xf).index_add_(0, tok, ys)
        self.last_load = counts.detach()
        if self.training:
            self.tokens_per_expert = self.tokens_per_expert.to(counts.device) + self.last_load
        if self.shared is not None:
            out = out + self.shared(xf)
        return out.view(shape)

    def take_load(self) -> torch.Tensor:
        """Tokens routed to each expert (E,) by the training forwards since the last call; resets the count."""
        load, self.tokens_per_expert = self.tokens_per_expert, torch.zeros_like(self.tokens_per_expert)
        return load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Loss-free balancing step: under-loaded experts' selection bias up, over-loaded down, by `speed`."""
        if self.speed > 0:
            load = load.to(self.expert_bias.dtype)
            self.expert_bias += self.speed * torch.sign(load.mean() - load)


def update_expert_bias(model: nn.Module, reduce=None) -> None:
    """One balancing step for every MoE layer of `model`, from the loads counted since the last call.

    `reduce(load) -> load` sums the load over data-parallel ranks (`engram.distributed`), so the
    bias moves as it would in one process. Call once per optimizer step (the trainer does).
    """
    for mod in model.modules():
        if isinstance(mod, MoE):
            load = mod.take_load()
            mod.update_bias(reduce(load) if reduce is not None else load)


class Block(nn.Module):
    def __init__(self, cfg: EngramLMConfig, idx: int, mapping=None):
        super().__init__()
        self.idx, self.n = idx, cfg.hc_mult
        ecfg = cfg.engram_config
        self.engram = (Engram(idx, ecfg, cfg.backbone_config, mapping)
                       if cfg.use_engram and idx in ecfg.layer_ids else None)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, idx)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.ffn == "moe" else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        if self.n > 1:
            self.hc_attn = HyperConnection(cfg.hidden_size, self.n, cfg.sinkhorn_iters)
            self.hc_ffn = HyperConnection(cfg.hidden_size, self.n, cfg.sinkhorn_iters)

    def forward(self, x, pos, cache=None, rows=None, engram_scale: float = 1.0, gates: dict | None = None):
        # x: (B, T, G, D); rows: this block's Engram rows (B, T, H, d), None when it has no Engram or it is off
        if rows is not None:
            state = cache.engram_state(self.idx) if isinstance(cache, NgramHistory) else None
            delta, g = self.engram(x, rows, state)  # (B, T, G, D), (B, T, G)
            x = x + (delta if engram_scale == 1 else engram_scale * delta)
            if gates is not None:
                gates[self.idx] = g.detach()
        attn = lambda u: self.self_attn(self.input_layernorm(u), pos, cache)  # noqa: E731
        ffn = lambda u: self.mlp(self.post_attention_layernorm(u))  # noqa: E731
        if self.n == 1:
            u = x[:, :, 0]
            u = u + attn(u)
            u = u + ffn(u)
            return u.unsqueeze(2)
        return self.hc_ffn(self.hc_attn(x, attn), ffn)


def wait_rows(rows):
    """Rows handed over ahead of time: a tensor, or a pending value (`.wait()` -> tensor, e.g. the prefetcher's)."""
    return rows if isinstance(rows, torch.Tensor) else rows.wait()


class EngramModel(nn.Module):
    """Embedding + blocks + final norm: ids (B, T) + per-layer Engram inputs -> hidden (B, T, D).

    Each Engram layer gets either its rows (`engram_rows[layer]`: (B, T, H, d) or pending, from a
    prefetcher) or its hash ids (`hash_ids[layer]`: (B, T, H), from the data pipeline or
    `EngramForCausalLM`), which its table turns into rows. The model never hashes.
    """

    def __init__(self, cfg: EngramLMConfig):
        super().__init__()
        self.cfg = cfg
        self.mapping = get_hash_mapping(cfg.engram_config) if cfg.use_engram else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, i, self.mapping) for i in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.engram_scale = 1.0

    def rows_for(self, layer: Block, hash_ids: dict | None, engram_rows: dict | None):
        """Layer `layer`'s Engram rows (B, T, H, d), or None when it has no Engram or Engram is switched off."""
        if layer.engram is None or self.engram_scale == 0:
            return None
        given, name = (engram_rows, "engram_rows") if engram_rows is not None else (hash_ids, "hash_ids")
        if given is None:
            raise ValueError("EngramModel needs hash_ids or engram_rows for its Engram layers "
                             "(EngramForCausalLM.forward computes them from input_ids)")
        if layer.idx not in given:
            raise ValueError(f"{name} has no entry for Engram layer {layer.idx} (it has {sorted(given)}); give one "
                             "per Engram layer, as NgramHashMapping.hash / Prefetcher.submit return")
        if engram_rows is not None:
            return wait_rows(engram_rows[layer.idx])
        return layer.engram.multi_head_embedding(hash_ids[layer.idx])

    def forward(self, input_ids, cache=None, gates: dict | None = None, hash_ids: dict | None = None,
                engram_rows: dict | None = None):
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(past, past + T, device=input_ids.device)
        x = self.embed_tokens(input_ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)  # (B, T, G, D)
        for layer in self.layers:
            x = layer(x, pos, cache, self.rows_for(layer, hash_ids, engram_rows), self.engram_scale, gates)
        return self.norm(x.mean(dim=2))  # (B, T, D)


@dataclass
class EngramCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus `gates`: `{layer_id: (B, T, hc_mult)}` when `return_gates=True`."""

    gates: dict | None = None


class EngramForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = EngramLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_cache_class = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # target -> source (when tied)

    def __init__(self, config: EngramLMConfig):
        super().__init__(config)
        self.model = EngramModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.prefetcher = None  # engram.tables.Prefetcher.attach(model): it hashes and gathers ahead of each forward
        # Every module drew its weights in its constructor, in a fixed order the documented runs depend on, so
        # post_init only collects HF properties and ties; `_init_weights` is what from_pretrained uses for keys a
        # checkpoint lacks (and what `model.initialize_weights()` re-runs).
        with hf_init.no_init_weights():
            self.post_init()
        self.tie_weights()

    @torch.no_grad()
    def _init_weights(self, module):
        """Initialize `module`'s own parameters as its constructor does (transformers' guarded init functions,
        so weights already loaded from a checkpoint are left alone)."""
        if isinstance(module, nn.Embedding):  # token embedding and Engram tables: N(0, 1)
            hf_init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, nn.Linear):
            hf_init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            if module.bias is not None:
                bound = 1 / math.sqrt(module.in_features) if module.in_features > 0 else 0
                hf_init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            hf_init.ones_(module.weight)
        elif isinstance(module, ShortConv):
            hf_init.kaiming_uniform_(module.conv.weight, a=math.sqrt(5))
            if module.zero_init:
                hf_init.zeros_(module.conv.weight)
            hf_init.ones_(module.norm_weight)
        elif isinstance(module, Engram) and module.use_gate:
            hf_init.ones_(module.key_norm_weight)
            hf_init.ones_(module.query_norm_weight)
        elif isinstance(module, MoE):
            D, I = module.w_gate.shape[2], module.w_gate.shape[1]
            hf_init.normal_(module.w_gate, std=1 / math.sqrt(D))
            hf_init.normal_(module.w_up, std=1 / math.sqrt(D))
            hf_init.normal_(module.w_down, std=1 / math.sqrt(I))
            hf_init.zeros_(module.expert_bias)
        elif isinstance(module, HyperConnection):
            hf_init.normal_(module.phi.weight, std=1.0 / math.sqrt(module.phi.in_features))
            hf_init.constant_(module.alpha, module.alpha_init)
            hf_init.copy_(module.bias, module.initial_bias())

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @contextlib.contextmanager
    def engram_disabled(self, scale: float = 0.0):
        """Suppress (scale 0) or rescale Engram's contribution inside the block; restores on exit."""
        old = self.model.engram_scale
        self.model.engram_scale = scale
        try:
            yield self
        finally:
            self.model.engram_scale = old

    def engram_inputs(self, input_ids: torch.Tensor, history: torch.Tensor | None = None
                      ) -> tuple[dict | None, dict | None]:
        """(hash_ids, engram_rows) for this forward: hashed here, or prefetched when a Prefetcher is attached.

        With a cache, the n-grams of the new tokens reach back into the ids of earlier calls:
        `history` holds them (`EngramCache` keeps the last N-1; `_advance_history` reads them).
        """
        mapping = self.model.mapping
        if mapping is None or self.model.engram_scale == 0:
            return None, None
        if self.prefetcher is not None:
            # this step's lookups start on the prefetch thread; blocks before the first Engram layer run meanwhile
            return None, self.prefetcher.submit(input_ids, history)
        return mapping.hash_continuation(input_ids, history), None

    def _advance_history(self, input_ids: torch.Tensor, cache) -> torch.Tensor | None:
        """The ids before `input_ids` kept by the cache (None without one); the cache then keeps the new ones too."""
        if self.model.mapping is None or cache is None:
            return None
        history = None
        if cache.get_seq_length() > 0:
            if not isinstance(cache, NgramHistory):
                raise ValueError(f"decoding with a {type(cache).__name__} loses the token ids Engram hashes; pass "
                                 "past_key_values=engram.model.EngramCache() (generate() creates one)")
            history = cache.ngram_history
        if isinstance(cache, NgramHistory):
            cache.push_ngram_history(input_ids, self.model.mapping.max_ngram_size - 1)
        return history

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, labels=None, use_cache=None,
                return_gates: bool = False, engram_scale: float | None = None, hash_ids: dict | None = None,
                cache=None, engram_rows: dict | None = None, logits_to_keep: int | torch.Tensor = 0, **kwargs):
        """Logits (B, T, vocab); `labels` (B, T) gives the next-token loss.

        `logits_to_keep` (transformers' convention): an int k > 0 projects only the last k positions, a 1-D tensor
        of positions only those, giving (B, K, vocab); 0 keeps every position. Not with `labels`.

        Engram inputs per layer, when computed ahead: `hash_ids` `{layer: (B, T, H)}` (the data
        pipeline, `Batcher`) or `engram_rows` `{layer: (B, T, H, d) or pending}` (`Prefetcher.submit`);
        otherwise they are computed from `input_ids` (and the cache's id history) here.
        """
        if input_ids is None:
            raise ValueError("input_ids (B, T) are required (Engram hashes token ids; inputs_embeds are not supported)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if cache is not None:  # transformers >= 5.24 names the KV cache `cache`
            past_key_values = cache
        if use_cache and past_key_values is None:
            past_key_values = EngramCache()
        gates = {} if return_gates else None
        old = self.model.engram_scale
        if engram_scale is not None:
            self.model.engram_scale = engram_scale
        try:
            history = self._advance_history(input_ids, past_key_values)  # also when the inputs came computed ahead
            if hash_ids is None and engram_rows is None:
                hash_ids, engram_rows = self.engram_inputs(input_ids, history)
            h = self.model(input_ids, past_key_values, gates, hash_ids, engram_rows)
        finally:
            self.model.engram_scale = old
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep:
            if labels is not None:
                raise ValueError("logits_to_keep drops positions the loss needs: pass labels or it, not both")
            h = h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else h[:, logits_to_keep]  # (B, K, D)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return EngramCausalLMOutput(loss=loss, logits=logits, gates=gates, **{CACHE_FIELD: past_key_values})

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate` with an `EngramCache` (KV cache + n-gram id history) unless one is passed."""
        if kwargs.get("use_cache", True) and kwargs.get(CACHE_FIELD) is None:
            kwargs[CACHE_FIELD] = EngramCache()
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, cache=None, **kwargs):
        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, past_key_values.get_seq_length():]
        return {"input_ids": input_ids, CACHE_FIELD: past_key_values, "use_cache": True}

    # ---------------------------------------------------------------- hashing manifest
    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the hashing manifest and a checksum manifest of every file (last)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.model.mapping is not None:
            self.model.mapping.save_spec(Path(save_directory) / SPEC_FILE)
        write_manifest(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        d = Path(pretrained_model_name_or_path)
        recover_dir(d)  # a save interrupted between its renames leaves the old folder aside
        if d.is_dir():  # every file against its checksum first: a corrupt file is one line, not wrong numbers
            verify_manifest(d)
        config = kwargs.get("config")
        if config is None and (d / "config.json").is_file():
            config = EngramLMConfig.from_pretrained(d)
        if isinstance(config, EngramLMConfig):
            resolve_tokenizer_path(config, d)
            kwargs["config"] = config
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if model.model.mapping is not None:
            check_saved_spec(model.model.mapping, d)
        return model


def resolve_tokenizer_path(config: EngramLMConfig, folder: Path) -> None:
    """A tokenizer saved beside the weights is referenced relative to the checkpoint folder: make it absolute."""
    tok = config.engram.get("tokenizer_name_or_path")
    if tok and not os.path.isabs(tok) and (folder / tok).exists():
        config.engram = {**config.engram, "tokenizer_name_or_path": str((folder / tok).resolve())}


def check_saved_spec(mapping, folder: Path) -> None:
    """Refuse a checkpoint folder whose hashing manifest is missing or differs from `mapping` (ConfigError)."""
    spec_path = Path(folder) / SPEC_FILE
    if not spec_path.is_file():
        raise ConfigError(f"{spec_path} is missing: an Engram checkpoint must carry its hashing manifest")
    mapping.check_spec(read_json(spec_path, "hash manifest", "re-save the model", ConfigError), str(folder))


def load_model(path, dtype=None, device=None) -> tuple[EngramForCausalLM, object]:
    """A run dir (uses DIR/final) or a save_pretrained folder -> (model in eval mode, its `tokenizers` tokenizer).

    `dtype` ("float32", "bfloat16", "float16" or a torch dtype; None: float32, as saved) is the dense weights';
    the Engram tables keep their rows' dtype (`placement.place`: `--table-format` converts those). `device` (None:
    the CPU) is where all of it goes. Both are checked before anything is read (`placement.check_placement`)."""
    from .placement import check_placement, place

    dtype, device = check_placement(dtype, device)
    p = Path(path)
    recover_dir(p / "final")  # a save interrupted between its renames leaves the old folder aside
    if (p / "final" / "config.json").is_file():
        p = p / "final"
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: no model here (expected config.json and model.safetensors, or a run dir "
                                "with final/)")
    try:
        model = EngramForCausalLM.from_pretrained(p).eval()
    except IntegrityError:
        raise
    except Exception as e:  # a parser error of a file the manifest could not vouch for (an older save)
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{p}: could not load the model ({type(e).__name__}: {msg}); re-save or re-download it") \
            from None
    tok = load_tokenizer(p / "tokenizer.json" if (p / "tokenizer.json").is_file()
                         else model.config.engram.get("tokenizer_name_or_path"))
    return place(model, dtype, device), tok


AutoConfig.register("engram", EngramLMConfig, exist_ok=True)
AutoModelForCausalLM.register(EngramLMConfig, EngramForCausalLM, exist_ok=True)
