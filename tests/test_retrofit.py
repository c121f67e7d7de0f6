"""`engram experiment retrofit`: the Pareto front, and (slow) the whole sweep on a tiny base."""

import json

import pytest

from engram.analysis.retrofit import pareto


def test_pareto_front_keeps_only_undominated_points():
    pts = [{"forgetting": 0.1, "domain_val": 5.0}, {"forgetting": 0.2, "domain_val": 4.0},
           {"forgetting": 0.3, "domain_val": 4.5},  # dominated by the second
           {"forgetting": 0.05, "domain_val": 6.0}, {"forgetting": 0.2, "domain_val": 4.0}]  # a tie stays
    assert pareto(pts) == [3, 0, 1, 4]
    assert pareto([]) == []


@pytest.mark.slow
def test_retrofit_sweep_on_a_tiny_base(tmp_path):
    pytest.importorskip("peft")
    from engram.analysis import retrofit as rf

    general, domain = tmp_path / "general.txt", tmp_path / "domain"
    general.write_text("".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(300)))
    domain.mkdir()
    for k in range(6):
        (domain / f"d{k}.txt").write_text("".join(f"word{i} (noun): a thing of kind {i % 7}\n" for i in range(80)))
    methods = {"full": (dict(method="full"), (1e-4, 1e-3)),
               "lora-all": (dict(method="lora", lora_rank=2, lora_targets="all-linear"), (1e-3,)),
               "engram": (dict(method="engram", layers=[0], engram_options=dict(
                   engram_vocab_size=[211, 211], n_embed_per_ngram=8, n_head_per_ngram=2)), (1e-3,))}
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    s = rf.run(tmp_path / "out", seeds=2, max_steps=3, pretrain_steps=3, progress=False, record=tmp_path / "rec",
               methods=methods, domain=[str(domain)], general=[str(general)], base_shape=base, tokenizer="bpe:300")
    assert len([r for r in s["runs"] if r["seed"] == 0]) == 4  # the sweep; then seed 1 at each chosen lr
    extra = ({(p[k]["method"], p[k]["lr"]) for p in s["matched"] for k in "ab"}
             - {(m, c["lr"]) for m, c in s["chosen"].items()})
    assert len(s["runs"]) == 4 + 3 + len(extra)
    assert all(p["a"]["domain_val"]["n"] == 2 for p in s["matched"])
    assert all(s["chosen"][m]["domain_val"]["n"] == 2 for m in methods)
    assert s["chosen"]["full"]["lr"] == min((r for r in s["runs"] if r["method"] == "full" and r["seed"] == 0),
                                            key=lambda r: r["domain_val"])["lr"]
    assert s["pareto_front"] and set(s["tests"]) == {"full", "lora-all"}
    assert json.loads((tmp_path / "rec" / "retrofit.json").read_text())["runs"] == s["runs"]
    assert (tmp_path / "out" / "retrofit" / "plot.png").is_file()
