"""One vLLM step's Engram work, shared by engram's own vLLM model (`model.py`) and the base + adapter models
(`adapter_model.py`): locate the step's tokens in the per-slot store (`state.py`), hash each token after its own
previous N-1 ids, and compute an Engram layer's delta with the short conv reading its taps' inputs (K positions,
not its whole window).

    state = new_state(vllm_config)                                   # in the model's __init__
    view = step_view(state, attn_layer_name, input_ids, positions)   # None: a profiling / dummy run
    ids = hash_ids(state, mapping, input_ids[:n], view)             # {layer: (n, H)} table rows
    delta = engram_delta(state, engram, x[:n], ids, view, choice)   # (n, G, D), as Engram.forward's
                                                 # choice: the step's per-request overlays (overlays.py), or None
"""

from __future__ import annotations

import torch

from . import _kernels
from .state import SlotState, StepView


def new_state(vllm_config) -> SlotState:
    """A model's per-slot store, made in vLLM's worker, which owns the process's OpenMP threads: engram's numba
    kernels run serially from here on (`jit.leave_threads_to_host`; a step's hashing is small)."""
    from ...jit import leave_threads_to_host

    leave_threads_to_host()
    return SlotState(vllm_config.cache_config.block_size)


def step_view(state: SlotState, attn_layer_name: str, input_ids, positions) -> StepView | None:
    """This step's `StepView`; None for vLLM's profiling and dummy runs (no forward context, or no attention
    metadata at all), whose tokens are hashed as one sequence. A real step's metadata that lacks what the
    slot store reads raises (`SlotState.view`), never a silently wrong step. `attn_layer_name`: any attention
    layer's name (every layer of these models shares one KV layout)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available  # (the rest runs without vLLM)

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # one dict per micro-batch (not used on this path)
        md = md[0] if md else None
    if md is None:
        return None
    return state.view(md.get(attn_layer_name) if isinstance(md, dict) else md, input_ids, positions)


def hash_ids(state: SlotState, mapping, input_ids: torch.Tensor, view: StepView | None) -> dict:
    """{layer: (n, H)} rows of each layer's table (head offsets added) for the step's tokens, each hashed after its
    own previous N-1 ids (`SlotState.hash`: one kernel call for the whole step on CPU)."""
    if view is None:  # profiling / dummy run: the tokens as one sequence (no state read or written)
        return {k: v[0] for k, v in mapping.hash(input_ids.cpu().long()[None], offsets=True).items()}
    return state.hash(view, mapping)


def engram_delta(state: SlotState, eng, x: torch.Tensor, ids: dict, view: StepView | None,
                 choice=None) -> torch.Tensor:
    """Engram layer `eng`'s delta (n, G, D) for hidden x (n, G, D), the conv reading earlier positions' inputs
    (kept in `state` under the layer's id). `choice`: this step's per-request overlays (`overlays.StepChoice`: each
    token's rows from its request's overlays where they have them), or None. On CPU a few calls (`_kernels`: the
    projection, then one kernel for gate, gated value and conv); elsewhere, or with ENGRAM_FUSED=0, the torch ops
    of `Engram.forward`."""
    lid = eng.layer_id
    rows = eng.multi_head_embedding.gather(ids[lid])  # (n, H, d): ids are table rows
    if choice is not None:
        rows = choice.apply(lid, rows, ids[lid])
    if view is not None and _kernels.usable(eng, x):
        fused = _kernels.layer(eng)
        kv = fused.project(rows.flatten(start_dim=1).to(x.dtype))  # (n, (Gk+1)*D)
        if not eng.use_short_conv:
            return fused.delta(kv, x)
        store = state.conv_store(lid, view, eng.hidden_size, eng.hc_mult, x)
        return fused.delta(kv, x, view, store)  # the kernel writes this step's entries, then reads the taps
    value, gate = eng.gated_value(x.unsqueeze(1), rows.unsqueeze(1))  # (n, 1, D), (n, 1, G)
    if eng.use_short_conv and view is not None:  # the conv reads its K taps' kept (value, gate), its own included
        state.write_conv(lid, view, value[:, 0], gate[:, 0])
        value, gate = state.conv_taps(lid, view, eng.short_conv.taps, eng.hidden_size)  # (n, K, D), (n, K, G)
    elif eng.use_short_conv:  # profiling / dummy run: the tokens as one sequence (no state)
        return eng.mix(eng.branch_value(value, gate).transpose(0, 1))[0]
    return eng.mix_at_taps(eng.branch_value(value, gate))  # as Engram.forward steps 4-5
