"""`EngramForCausalLM` for vLLM: engram's language model written with vLLM's layers.

Same computation as `engram.model.EngramForCausalLM` (read it first), token by token:

    ids (n,) -> embed_tokens -> x (n, G, D)   n = the step's scheduled tokens of all requests, flattened
    per block i:  x = x + Engram_i(x, rows_i)        (Engram layers only; rows from the n-gram hash ids)
                  x = HC_attn(x, Attn(RMSNorm(.)))   (plain residual when G == 1)
                  x = HC_ffn (x, FFN (RMSNorm(.)))
    -> mean over streams -> norm -> lm_head (vLLM's LogitsProcessor)

What comes from vLLM: attention with its paged KV cache (`Attention`: continuous batching, chunked
prefill, prefix caching), `QKVParallelLinear` / `RowParallelLinear` / `MergedColumnParallelLinear`
(tensor parallel), `get_rope` (engram rotates interleaved pairs: GPT-J style, `is_neox_style=False`),
`RMSNorm`, `VocabParallelEmbedding`, `ParallelLMHead`. What comes from engram, as modules with the
checkpoint's own parameter names: the Engram layers (`engram.memory.Engram`: table, gate, short conv),
the mHC mixing (`engram.hyper.HyperConnection`) and DeepSeekMoE (`engram.model.MoE`). These run
replicated on every tensor-parallel rank (their inputs are the full hidden states every rank holds), so
TP=2 computes exactly TP=1's Engram rows. Hashing goes through `engram.hashing` (`hash_continuation` with
each token's previous N-1 ids, which `state.SlotState` keeps per KV slot, as the conv inputs).

Tables: the checkpoint's rows are loaded into the Engram layer's table parameter, then the options
(`options.py`) are applied by engram's one inference path, `inference.prepare_inference` (tier, overlays checked
against the checkpoint's weights digest read from its files, format, overlays applied), as `engram sample` does;
per-request overlays are checked the same way and kept beside the tables (`overlays.py`: each token reads its own
request's rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ...hashing import get_hash_mapping
from ...hyper import HyperConnection
from ...memory import Engram, defer_table_allocation
from ...model import MoE, check_saved_spec, resolve_tokenizer_path
from ...persist import verify_manifest
from .options import table_options
from .overlays import load_table_options
from .state import StepView
from .step import engram_delta, hash_ids, new_state, step_view

# checkpoint name piece -> (vLLM parameter name piece, shard id) for the fused projections
STACKED = [(".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
           (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1)]


class EngramAttention(nn.Module):
    """RoPE GQA attention: fused QKV, vLLM's rotary embedding (interleaved pairs), paged attention, output proj."""

    def __init__(self, cfg, cache_config, quant_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = hd = cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(hd, cfg.max_position_embeddings, is_neox_style=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
        self.attn = Attention(self.num_heads, hd, hd ** -0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class SwiGLUMLP(nn.Module):
    """engram's SwiGLU FFN with vLLM's tensor-parallel linears (gate and up fused)."""

    def __init__(self, hidden: int, inter: int, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x):
        h, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(h))
        return out


class EngramDecoderLayer(nn.Module):
    """One block: [Engram], attention and FFN, each wrapped in mHC mixing when hc_mult > 1."""

    def __init__(self, cfg, idx: int, mapping, cache_config, quant_config, prefix: str):
        super().__init__()
        self.idx, self.n = idx, cfg.hc_mult
        ecfg = cfg.engram_config
        with defer_table_allocation():  # the checkpoint's rows arrive in load_weights: no init, no storage here
            self.engram = (Engram(idx, ecfg, cfg.backbone_config, mapping)
                           if cfg.use_engram and idx in ecfg.layer_ids else None)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = EngramAttention(cfg, cache_config, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = (MoE(cfg) if cfg.ffn == "moe"
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, f"{prefix}.mlp"))
        if self.n > 1:
            self.hc_attn = HyperConnection(cfg.hidden_size, self.n, cfg.sinkhorn_iters)
            self.hc_ffn = HyperConnection(cfg.hidden_size, self.n, cfg.sinkhorn_iters)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (n, G, D) -> (n, G, D) (the Engram delta was added by the model)."""
        attn = lambda u: self.self_attn(positions, self.input_layernorm(u))  # noqa: E731  (n, D) -> (n, D)
        ffn = lambda u: self.mlp(self.post_attention_layernorm(u))  # noqa: E731
        if self.n == 1:
            u = x[:, 0]
            u = u + attn(u)
            u = u + ffn(u)
            return u.unsqueeze(1)
        x4 = x.unsqueeze(1)  # (n, 1, G, D): HyperConnection's (B, T, G, D) with one token per row
        x4 = self.hc_attn(x4, lambda u: attn(u[:, 0]).unsqueeze(1))
        return self.hc_ffn(x4, lambda u: ffn(u[:, 0]).unsqueeze(1))[:, 0]


class EngramModel(nn.Module):
    def __init__(self, cfg, mapping, cache_config, quant_config, prefix: str):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList([EngramDecoderLayer(cfg, i, mapping, cache_config, quant_config,
                                                        f"{prefix}.layers.{i}") for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EngramForCausalLM(nn.Module):
    """vLLM's model class for `architectures: ["EngramForCausalLM"]` (engram's saved models)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.folder = Path(vllm_config.model_config.model)
        self.options = table_options(cfg)
        resolve_tokenizer_path(cfg, self.folder)
        self.config = cfg
        self.mapping = get_hash_mapping(cfg.engram_config) if cfg.use_engram else None
        self.model = EngramModel(cfg, self.mapping, vllm_config.cache_config, vllm_config.quant_config,
                                 f"{prefix}model" if not prefix else f"{prefix}.model")
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix="lm_head" if not prefix else f"{prefix}.lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.state = new_state(vllm_config)
        self.engram_layers = [layer for layer in self.model.layers if layer.engram is not None]
        self.overlay_bank = None  # the per-request overlays (`overlays.OverlayBank`), set in load_weights

    # ------------------------------------------------------------------------------------- forward
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _step_view(self, input_ids, positions) -> StepView | None:
        """This step's `StepView` (`step.step_view`); None for vLLM's profiling and dummy runs."""
        return step_view(self.state, self.model.layers[0].self_attn.attn.layer_name, input_ids, positions)

    def _hash_ids(self, input_ids: torch.Tensor, view: StepView | None) -> dict:
        """{layer: (n, H)} per-head hash ids of the step's tokens, each after its own previous N-1 ids."""
        return hash_ids(self.state, self.mapping, input_ids, view)

    def _engram_delta(self, layer: EngramDecoderLayer, x: torch.Tensor, ids: dict, view, choice=None) -> torch.Tensor:
        """Engram layer's delta (n, G, D) for hidden x (n, G, D), the conv reading earlier positions' inputs, each
        token's rows from its request's overlays (`choice`) where it chose any."""
        return engram_delta(self.state, layer.engram, x, ids, view, choice)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if input_ids is None:
            raise ValueError("engram's vLLM model needs input_ids (Engram hashes token ids; no inputs_embeds)")
        n_all = input_ids.shape[0]
        view = self._step_view(input_ids, positions) if self.engram_layers else None
        n = view.n if view is not None else n_all
        on = bool(self.engram_layers) and self.options.scale != 0 and n > 0
        hash_ids = self._hash_ids(input_ids[:n], view) if on else None
        choice = self.overlay_bank.for_step(view) if on and self.overlay_bank is not None else None
        x = self.model.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1)  # (n_all, G, D)
        for layer in self.model.layers:
            if on and layer.engram is not None:
                delta = self._engram_delta(layer, x[:n], hash_ids, view, choice)
                x = x + (delta if n == n_all else torch.cat([delta, delta.new_zeros(n_all - n, *delta.shape[1:])]))
            x = layer(x, positions)
        return self.model.norm(x.mean(dim=1))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ------------------------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load engram's saved names (q/k/v and gate/up fused here), then apply the table options."""
        verify_manifest(self.folder)  # a corrupt checkpoint: engram's one-line IntegrityError, as from_pretrained
        if self.mapping is not None:
            check_saved_spec(self.mapping, self.folder)
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded = set()
        for name, w in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for old, new, shard in STACKED:
                if old in name and ".mlp.shared." not in name and (shard in ("q", "k", "v") or
                                                                   self.config.ffn == "mlp"):
                    target = name.replace(old, new)
                    params[target].weight_loader(params[target], w, shard)
                    loaded.add(target)
                    break
            else:
                if name in buffers:
                    buffers[name].copy_(w)
                    continue
                if name not in params:
                    raise KeyError(f"{self.folder}: checkpoint tensor {name!r} has no place in engram's vLLM model")
                p = params[name]
                if name.endswith("multi_head_embedding.embedding.weight"):  # the table: its real rows, as saved
                    mhe = self.get_submodule(name.rsplit(".embedding.weight", 1)[0])
                    mhe.embedding.weight = nn.Parameter(w.to(p.dtype).contiguous(), requires_grad=False)
                else:
                    getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        self._apply_table_options()
        return loaded

    def _apply_table_options(self) -> None:
        """Tier, format and overlays (`overlays.load_table_options`: engram's one inference path), the overlays
        checked against the checkpoint's digest read from its files (no second model in the worker)."""
        if not self.engram_layers:
            return
        from ...adapters.introspect import checkpoint_digest

        self.overlay_bank = load_table_options(self, self.options, lambda: checkpoint_digest(self.folder))
