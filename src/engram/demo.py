"""The seed tutorial's demo LLM: token embedding, `num_layers` blocks with Engram at `layer_ids`, LM head.

As in the reference demo, attention and MoE inside the blocks are pass-through mocks: the
point is to show Engram's shapes and gates inside a 30-layer, 4-stream model. Hashing runs
once for all Engram layers before the first block (addresses depend only on the ids).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import BackBoneConfig, EngramConfig, check_layer_ids
from .hashing import get_hash_mapping
from .memory import Engram


class MockBlock(nn.Module):
    """Tutorial block: `h = h + Engram(h)` (if this is an Engram layer), then identity attention and MoE."""

    def __init__(self, layer_id: int, engram_cfg: EngramConfig, backbone_cfg: BackBoneConfig, mapping):
        super().__init__()
        self.layer_id = layer_id
        self.engram = Engram(layer_id, engram_cfg, backbone_cfg, mapping) if layer_id in engram_cfg.layer_ids else None

    def forward(self, h: torch.Tensor, hash_ids: dict, gates: dict | None = None) -> torch.Tensor:
        if self.engram is not None:
            out, g = self.engram(h, hash_ids=hash_ids[self.layer_id], return_gates=True)
            h = h + out
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
