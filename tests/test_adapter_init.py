"""`engram experiment adapter-init`: the rule that picks the adapter tables' init, and (slow) the whole sweep."""

import json

import pytest

pytest.importorskip("scipy")

from engram_experiments.adapter_init import analyze


def _runs(effect: dict, noise=(0.0, 0.01, -0.01, 0.005)):
    """val loss = cell level + effect[init] + a per-seed offset shared by the inits (what pairing removes)."""
    out = []
    for c, level in (("a on x", 5.0), ("a on y", 6.0), ("b on x", 5.5), ("b on y", 6.5)):
        for seed, n in enumerate(noise):
            for init, e in effect.items():
                out.append({"cell": c, "init": init, "seed": seed, "val_loss": level + n + e(c, seed)})
    return out


def test_choice_is_the_lowest_mean_and_its_lead_is_tested_paired():
    # 1.0 is better by 0.05 nats everywhere, with a little seed-specific jitter: a finding, pooled and in every cell
    runs = _runs({0.02: lambda c, s: 0.05 + 0.002 * s, 1.0: lambda c, s: 0.0})
    r = analyze(runs, (0.02, 1.0))
    assert r["choice"] == 1.0
    assert r["mean"]["0.02"] - r["mean"]["1"] == pytest.approx(0.05 + 0.002 * 1.5)
    (t,) = r["pooled_tests"]
    assert (t["a"], t["b"], t["test"]) == (0.02, 1.0, "paired t, n=16")
    assert t["diff"] == pytest.approx(-(0.05 + 0.002 * 1.5)) and t["finding"]
    assert len(r["cell_tests"]) == 4 and all(x["test"] == "paired t, n=4" for x in r["cell_tests"])
    assert r["lead"]["0.02"] == {"finding": True, "cells": ["a on x", "a on y", "b on x", "b on y"]}
    assert r["table"]["a on x"]["1"]["n"] == 4


def test_a_lead_inside_the_noise_is_not_a_finding():
    # 0.02 ahead on average but its sign flips with the seed: chosen (lowest mean) yet not a finding anywhere
    jitter = (-0.03, 0.029, -0.028, 0.027)
    r = analyze(_runs({0.02: lambda c, s: jitter[s], 0.1: lambda c, s: 0.0, 1.0: lambda c, s: 0.2}),
                (0.02, 0.1, 1.0))
    assert r["choice"] == 0.02
    assert r["lead"]["0.1"] == {"finding": False, "cells": []}
    assert r["lead"]["1"]["finding"]  # 1.0 is 0.2 worse everywhere
    assert len(r["pooled_tests"]) == 3 and len(r["cell_tests"]) == 12
    p = [t["p"] for t in r["cell_tests"]]  # Holm: adjusted >= raw, capped at 1
    assert all(t["p_holm"] >= t["p"] and t["p_holm"] <= 1 for t in r["cell_tests"]) and min(p) < 1


@pytest.mark.slow
def test_sweep_on_tiny_bases(tmp_path):
    from engram_experiments import adapter_init as ai

    general, x, y = tmp_path / "general.txt", tmp_path / "x", tmp_path / "y"
    general.write_text("".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(300)))
    for d, word in ((x, "thou"), (y, "verily")):
        d.mkdir()
        for k in range(4):
            (d / f"d{k}.txt").write_text("".join(f"{word} {i} said the {word} of kind {i % 7}\n" for i in range(80)))
    fam = {"gpt2": dict(n_embd=16, n_layer=2, n_head=2, n_inner=32, n_positions=64),
           "gpt_neox": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=64)}
    s = ai.run(tmp_path / "out", seeds=2, max_steps=2, progress=False, record=tmp_path / "rec", families=fam,
               datasets=(str(x), str(y)), general=[str(general)], tokenizer="bpe:300",
               engram_options=dict(engram_vocab_size=[211, 211], n_embed_per_ngram=8, n_head_per_ngram=2))
    assert len(s["runs"]) == 2 * 2 * 2 * 2  # families x datasets x seeds x candidates
    assert s["choice"] in ai.CANDIDATES and set(s["table"]) == {"gpt2 on x", "gpt2 on y", "gpt_neox on x",
                                                               "gpt_neox on y"}
    rec = json.loads((tmp_path / "rec" / "adapter-init.json").read_text())
    assert rec["runs"] == s["runs"] and rec["environments"]
    assert (tmp_path / "out" / "adapter-init" / "plot.png").is_file()
    again = ai.run(tmp_path / "out", seeds=2, max_steps=2, progress=False, families=fam, datasets=(str(x), str(y)),
                   general=[str(general)], tokenizer="bpe:300",
                   engram_options=dict(engram_vocab_size=[211, 211], n_embed_per_ngram=8, n_head_per_ngram=2))
    assert again["runs"] == s["runs"]  # finished runs are reused, not trained again
