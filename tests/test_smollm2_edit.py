"""`engram experiment smollm2-edit` (issue 46 item 3): the fact sets, the selection score and the preregistered family,
on synthetic runs (the experiment itself runs SmolLM2 for ~25 min: `engram experiment smollm2-edit`)."""

import pytest

from engram_experiments import prereg
from engram_experiments import smollm2_edit as se
from engram_experiments.known_facts import all_facts
from engram_experiments.runs import ExperimentError


def design():
    return prereg.load(se.NAME, record=False).design


def test_fact_sets_are_disjoint_known_facts_with_counterfactual_targets():
    d = design()
    facts = all_facts()
    sets = se.fact_sets(facts, d)
    tests = [s for s in sets if s.startswith("test-")]
    assert len(tests) == d["sets"]["count"]
    prompts = [f.prompt for v in sets.values() for _, f, _ in v]
    assert len(prompts) == len(set(prompts))  # no fact in two sets
    assert all(r == d["sets"]["relation"] for s in tests for r, _, _ in sets[s])
    assert all(r == d["sets"]["selection_relation"] for r, _, _ in sets["selection"])
    assert all(f.target != true for v in sets.values() for _, f, true in v)
    assert se.fact_sets(facts, d) == sets  # seeded
    few = [rf for rf in facts if rf[0] != d["sets"]["relation"]][:40] + \
        [rf for rf in facts if rf[0] == d["sets"]["relation"]][:d["sets"]["count"] * d["sets"]["min_size"] - 1]
    with pytest.raises(ExperimentError, match="too few"):
        se.fact_sets(few, d)


def test_the_score_weighs_efficacy_and_both_specificities_and_never_paraphrases():
    m = {"efficacy": 1.0, "paraphrases": 0.0, "specificity_same": 1.0, "specificity_other": 1.0, "fluency_change": 0}
    assert se.score(m) == 1.0  # paraphrases are not selected on (amendment 1)
    assert se.score({**m, "specificity_same": 0.0}) == pytest.approx(2 / 3)  # a 0 no longer makes every rate tie
    assert se.score({**m, "efficacy": 0.5}) < se.score({**m, "efficacy": 0.75})


def test_selection_ranks_by_score_then_efficacy_then_the_larger_rate():
    m = {"efficacy": 0.0, "paraphrases": 0.0, "specificity_same": 1.0, "specificity_other": 1.0, "fluency_change": 0}
    nothing = {1e-5: m, 3e-5: {**m, "fluency_change": 0.001}, 1e-4: {**m, "fluency_change": 0.002}}
    assert se.selection_rank(nothing)[1e-4] == 0  # nothing learned anywhere: the grid grows upward (amendment 2)
    edits = {0.03: {**m, "efficacy": 0.4, "specificity_other": 0.95}, 0.1: {**m, "efficacy": 1.0,
             "specificity_other": 0.95}, 0.3: {**m, "efficacy": 1.0, "specificity_other": 0.9}}
    assert se.selection_rank(edits) == {0.1: 0, 0.3: 1, 0.03: 2}
    broken = {1e-5: {**m, "efficacy": 1.0, "specificity_same": 0.0, "specificity_other": 0.21},
              3e-4: {**m, "efficacy": 1.0, "specificity_same": 0.0, "specificity_other": 0.0}}
    assert se.selection_rank(broken)[1e-5] == 0  # (amendment 3) what breaks less wins


def test_fine_tuning_trains_every_weight_of_a_base_with_an_adapter(tmp_path):
    """ft and ft+kl unfreeze what attaching an adapter froze; LoRA trains its own weights only."""
    from bases import tale_tokenizer, tiny_base

    import engram
    from engram_experiments.edit import finetune_model

    tok = tale_tokenizer(tmp_path / "tokenizer.json")

    def adapted():
        model = tiny_base("llama")
        engram.attach(model, layer_ids=[1], tokenizer=tok)
        assert not model.model.embed_tokens.weight.requires_grad
        return model

    model, opts = finetune_model(adapted(), "ft", 1e-4)
    assert all(p.requires_grad for p in model.parameters())
    assert sum(p.numel() for o in opts for g in o.param_groups for p in g["params"]) == \
        sum(p.numel() for p in model.parameters())
    model, _ = finetune_model(adapted(), "lora", 1e-3)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def synthetic(d, effect: float) -> dict:
    """A summary whose ft runs have efficacy `effect` above the edit's on every test set (others equal)."""
    runs = []
    methods = list(d["methods"])
    for i in range(d["sets"]["count"]):
        for m in methods:
            for b in d["budgets"]:
                base = {"efficacy": 0.5 + 0.05 * i, "paraphrases": 0.4, "specificity_same": 0.9 - 0.01 * i,
                        "specificity_other": 0.95, "fluency_change": 0.01 * i, "old_kept": 0.3}
                if m == "ft":
                    base["efficacy"] += effect
                runs.append({"set": f"test-{i}", "method": m, "lr": 1.0, "budget": b, **base,
                             "seconds_per_step": 0.2, "trainable_params": None if m == "engram-edit" else 10,
                             **({"rows_changed": 40} if m == "engram-edit" else {})})
    for m in methods:
        runs.append({"set": "selection", "method": m, "lr": 1.0, "budget": d["budgets"][-1], "efficacy": 1.0,
                     "paraphrases": 1.0, "specificity_same": 1.0, "specificity_other": 1.0, "fluency_change": 0.0,
                     "old_kept": 0.0, "seconds_per_step": 0.2, "trainable_params": None})
    s = {"design": d, "budgets": d["budgets"], "chosen_lr": {m: 1.0 for m in methods}, "grids": {m: [1.0] for m in
         methods}, "runs": runs, "known": {"base": 61, "start": 56, "of": 115, "by_relation": {"capital": 29}},
         "general_before": 3.48, "prereg": {"file": "f", "blob": "b", "status": "confirmatory", "commit": "c"},
         "sets": {"test-0": [{}] * 6}}
    return s | se.analyse(s)


def test_the_family_is_the_prereg_s_and_finds_a_consistent_difference_only():
    d = design()
    s = synthetic(d, 0.3)
    assert len(s["tests"]) == len(d["test"]["pairs"]) * len(d["test"]["metrics"])
    hit = [t for t in s["tests"] if t["finding"]]
    assert [(t["b"], t["metric"]) for t in hit] == [("ft", "efficacy")]
    assert hit[0]["diff"] == pytest.approx(0.3) and hit[0]["n"] == d["sets"]["count"]
    assert not any(t["finding"] for t in synthetic(d, 0.0)["tests"])
    md = se.markdown(s)
    assert "**finding**" in md and "| engram-edit | 1 | 50 |" in md and "40 table rows (overlay)" in md
