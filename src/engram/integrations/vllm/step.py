"""One vLLM step's Engram work, shared by engram's own vLLM model (`model.py`) and the base + adapter models
(`adapter_model.py`): locate the step's tokens in the per-slot store (`state.py`), hash each token after its own
previous N-1 ids, and compute an Engram layer's delta with the short conv reading earlier positions' inputs.

    view = step_view(state, attn_layer_name, input_ids, positions)   # None: a profiling / dummy run
    ids = hash_ids(state, mapping, input_ids[:n], view)             # {layer: (n, H)}
    delta = engram_delta(state, engram, x[:n], ids, view)           # (n, G, D), as Engram.forward's
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from .state import SlotState, StepView


def step_view(state: SlotState, attn_layer_name: str, input_ids, positions) -> StepView | None:
    """This step's `StepView`; None for vLLM's profiling and dummy runs (no forward context, or no attention
    metadata at all), whose tokens are hashed as one sequence. A real step's metadata that lacks what the
    slot store reads raises (`SlotState.view`), never a silently wrong step. `attn_layer_name`: any attention
    layer's name (every layer of these models shares one KV layout)."""
    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # one dict per micro-batch (not used on this path)
        md = md[0] if md else None
    if md is None:
        return None
    return state.view(md.get(attn_layer_name) if isinstance(md, dict) else md, input_ids, positions)


def hash_ids(state: SlotState, mapping, input_ids: torch.Tensor, view: StepView | None) -> dict:
    """{layer: (n, H)} per-head hash ids of the step's tokens, each after its own previous N-1 ids."""
    if view is None:  # profiling / dummy run: the tokens as one sequence (no state read or written)
        return {k: v[0] for k, v in mapping.hash(input_ids.cpu().long()[None]).items()}
    depth = mapping.max_ngram_size - 1
    state.write_ids(view)
    hist, lengths = state.history(view, depth)
    out: dict = {}
    for h in lengths.unique().tolist():  # tokens grouped by how many ids precede them (< N-1 near the start)
        sel = (lengths == h).nonzero().squeeze(1)
        got = mapping.hash_continuation(view.ids[sel, None], hist[sel, depth - h:] if h else None)
        for lid, rows in got.items():
            if lid not in out:
                out[lid] = rows.new_empty(view.n, rows.shape[-1])
            out[lid][sel] = rows[:, 0]
    return out


def engram_delta(state: SlotState, eng, x: torch.Tensor, ids: dict, view: StepView | None) -> torch.Tensor:
    """Engram layer `eng`'s delta (n, G, D) for hidden x (n, G, D), the conv reading earlier positions' inputs
    (kept in `state` under the layer's id)."""
    lid = eng.layer_id
    rows = eng.multi_head_embedding(ids[lid]).unsqueeze(1)  # (n, 1, H, d)
    value, gate = eng.gated_value(x.unsqueeze(1), rows)  # (n, 1, D), (n, 1, G)
    past = None
    if eng.use_short_conv and view is not None:  # the conv's taps read earlier positions' kept (value, gate)
        state.write_conv(lid, view, value[:, 0], gate[:, 0])
        hv, hg = state.conv_history(lid, view, eng.short_conv.lookback)
        past = eng.branch_value(hv, hg)  # (n, lookback, G, D)
    return eng.mix(eng.branch_value(value, gate), past)[:, 0]  # as Engram.forward steps 4-5
