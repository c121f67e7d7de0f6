"""The seed tutorial's demo LLM (`engram demo`, `model.py`): token embedding, `num_layers` blocks with Engram at
`layer_ids`, LM head.

As in the reference demo, attention and MoE inside the blocks are pass-through mocks: the
point is to show Engram's shapes and gates inside a 30-layer, 4-stream model. Hashing runs
once for all Engram layers before the first block (addresses depend only on the ids).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn

from ..config import BackBoneConfig, EngramConfig, check_layer_ids
from ..hashing import get_hash_mapping
from ..memory import Engram
from ..tokenizer import bos_id, encode, load_tokenizer
from ..utils import peak_rss_mib


class MockBlock(nn.Module):
    """Tutorial block: `h = h + Engram(h)` (if this is an Engram layer), then identity attention and MoE."""

    def __init__(self, layer_id: int, engram_cfg: EngramConfig, backbone_cfg: BackBoneConfig, mapping):
        super().__init__()
        self.layer_id = layer_id
        self.engram = Engram(layer_id, engram_cfg, backbone_cfg, mapping) if layer_id in engram_cfg.layer_ids else None

    def forward(self, h: torch.Tensor, hash_ids: dict, gates: dict | None = None) -> torch.Tensor:
        if self.engram is not None:
            rows = self.engram.multi_head_embedding(hash_ids[self.layer_id])  # (B, T, H, d)
            delta, g = self.engram(h, rows)  # (B, T, G, D), (B, T, G)
            h = h + delta
            if gates is not None:
                gates[self.layer_id] = g.detach()
        return h  # attention and MoE are identity mocks, as in the reference demo


class DemoLM(nn.Module):
    """`forward(input_ids (B, T)) -> logits (B, T, vocab)`; `forward_with_details` also returns hashes and gates."""

    def __init__(self, engram_cfg: EngramConfig | None = None, backbone_cfg: BackBoneConfig | None = None):
        super().__init__()
        self.engram_cfg = engram_cfg = engram_cfg or EngramConfig()
        self.backbone_cfg = backbone_cfg = backbone_cfg or BackBoneConfig()
        check_layer_ids(engram_cfg, backbone_cfg)
        self.hash_mapping = get_hash_mapping(engram_cfg)
        self.embed_tokens = nn.Embedding(backbone_cfg.vocab_size, backbone_cfg.hidden_size)
        self.blocks = nn.ModuleList(
            [MockBlock(i, engram_cfg, backbone_cfg, self.hash_mapping) for i in range(backbone_cfg.num_layers)]
        )
        self.lm_head = nn.Linear(backbone_cfg.hidden_size, backbone_cfg.vocab_size)

    def forward_with_details(self, input_ids: torch.Tensor):
        hash_ids = self.hash_mapping.hash(input_ids)  # {layer: (B, T, H)}
        G = self.backbone_cfg.hc_mult
        h = self.embed_tokens(input_ids).unsqueeze(2).expand(-1, -1, G, -1)  # (B, T, G, D)
        gates: dict = {}
        for block in self.blocks:
            h = block(h, hash_ids, gates)
        logits = self.lm_head(h[:, :, 0, :])  # (B, T, vocab)
        return logits, hash_ids, gates

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_with_details(input_ids)[0]


def run_demo(text: str, engram_cfg: EngramConfig, backbone_cfg: BackBoneConfig, mock_blocks: bool = False,
             seed: int = 0, bos: bool = True) -> dict:
    """The tutorial's forward demo: build the model, tokenize `text` as the tutorial does, one forward.

    Real blocks (`presets.demo`: RoPE attention, SwiGLU, mHC; needs transformers) unless
    `mock_blocks` (the reference demo's pass-through attention/MoE) or transformers is missing.
    Returns what `engram demo` prints: tokens, shapes, gate statistics per layer, parameter
    counts, wall times and peak RSS.
    """
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tok = load_tokenizer(engram_cfg.tokenizer_name_or_path)
    ids, tokens = encode(tok, text, bos=bos)
    prepended = bos_id(tok) if bos else None  # (id, token) of the BOS put first, or None
    if len(ids) == (1 if prepended else 0):  # nothing but the BOS token
        raise ValueError("--text is empty after tokenization; give some text")
    input_ids = torch.tensor([ids], dtype=torch.long)
    if not mock_blocks:
        try:
            import transformers  # noqa: F401
        except ImportError:
            mock_blocks = True
    if mock_blocks:
        model = DemoLM(engram_cfg, backbone_cfg).eval()
        engrams = [b.engram for b in model.blocks if b.engram is not None]
        blocks = "attention/MoE inside blocks are pass-through mocks (as in the reference demo)"
    else:
        from ..model import EngramForCausalLM
        from ..training import presets

        cfg = presets.demo(vocab_size=backbone_cfg.vocab_size, hidden_size=backbone_cfg.hidden_size,
                           num_hidden_layers=backbone_cfg.num_layers, hc_mult=backbone_cfg.hc_mult,
                           engram=engram_cfg.to_dict())
        model = EngramForCausalLM(cfg).eval()
        engrams = [b.engram for b in model.model.layers if b.engram is not None]
        blocks = (f"real blocks: RoPE attention ({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV), "
                  f"SwiGLU FFN ({cfg.intermediate_size}), mHC with {cfg.hc_mult} streams")
    t1 = time.perf_counter()
    with torch.no_grad():
        if mock_blocks:
            logits, hash_ids, gates = model.forward_with_details(input_ids)
        else:
            out = model(input_ids, return_gates=True)
            logits, gates, hash_ids = out.logits, out.gates, model.model.mapping.hash(input_ids)
    t2 = time.perf_counter()
    return {
        "mock_blocks": mock_blocks, "blocks": blocks, "tokens": tokens,
        "bos_token": prepended[1] if prepended else None,
        "input_shape": list(input_ids.shape), "output_shape": list(logits.shape),
        "layers": {lid: {"hash_shape": list(hash_ids[lid].shape), "gate_min": float(gates[lid].min()),
                         "gate_max": float(gates[lid].max()), "gate_mean": float(gates[lid].mean())}
                   for lid in engram_cfg.layer_ids},
        "params": sum(p.numel() for p in model.parameters()),
        "table_params": sum(e.multi_head_embedding.embedding.weight.numel() for e in engrams),
        "build_s": t1 - t0, "forward_s": t2 - t1, "total_s": t2 - t0,
        "peak_rss_gib": peak_rss_mib() / 1024,
        "config": {"engram": dataclasses.asdict(engram_cfg), "backbone": dataclasses.asdict(backbone_cfg)},
    }
