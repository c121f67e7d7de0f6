"""`engram experiment allocation`: the paper's sparsity allocation between MoE experts and Engram.

The paper (§3, Fig. 3) fixes a model's total and activated parameters and moves a share of the
*inactive* sparse budget, the routed experts a token does not use, into Engram table rows. With
`rho` the share of that budget kept by routed experts, validation loss traces a U in `rho` with
its minimum near 75-80%. This module builds that sweep on the DeepSeekMoE backbone:

* **Pure MoE** (`rho` = 100%): E0 routed experts, top-k, a shared expert, no Engram.
* **Variant with E routed experts**: the (E0 - E) experts it gives up become Engram rows, so
  `rho = (E - k) / (E0 - k)`. Its table is sized so that the **total** parameters equal the pure
  MoE's within one row group (one row in every head: `heads * head_dim` parameters; rows are
  primes, so the plan searches the two orders' sizes). Engram's own dense weights (key/value
  projection, norms, conv) and the rows a token reads are **activated**; the plan pays for them by
  narrowing the shared expert in every layer, so activated parameters also stay equal, within half
  a shared-FFN unit (`1.5 * hidden * layers` parameters).
* **Dense baselines** (same training): a SwiGLU FFN with the pure MoE's activated parameters
  (iso-activated, iso-FLOP) and one with its total parameters (iso-total: the whole sparse budget
  as dense weights, far more FLOPs).

Accounting (`accounting`) counts parameters on a meta-device model and measures forward FLOPs
per token with `torch.utils.flop_counter` on a real one, so a reader can check the fairness
claim. `run` trains every variant for every seed (resumable: one run directory each, finished
runs skipped), adds a third seed where neighbouring points are within two spreads, and writes
`accounting.json`, `summary.json`, `summary.md` and `plot.png`.

Scales: `cpu` (hidden 128, 4 layers; about 100 minutes on 2 cores) and `gpu` (hidden 512, 12
layers, >= 100M tokens per variant; `experiments/allocation_gpu.sh`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engram.config import ConfigError
from engram.persist import atomic_write_bytes, write_json

from .registry import Experiment, Runs, register
from .runs import read_result, seed_stats, trained_run

ROUTED_WEIGHTS = ("mlp.w_gate", "mlp.w_up", "mlp.w_down")
TABLE_WEIGHT = "multi_head_embedding.embedding.weight"


@dataclass(frozen=True)
class Scale:
    """One size of the sweep: the pure-MoE backbone and how long each variant trains."""

    preset: str  # training preset the runs start from (tokenizer, lr, schedule)
    model: dict  # model overrides: the pure-MoE backbone and the Engram layer(s) of the variants
    train: dict  # training overrides
    max_steps: int
    routed: tuple[int, ...]  # routed experts of each variant; the first is the pure MoE
    data: tuple[str, ...] = ("shakespeare", "kjv")
    dense_baselines: bool = True


SCALES = {
    "cpu": Scale("exp",
                 dict(ffn="moe", n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_intermediate_size=128),
                 dict(batch_size=16, eval_every=250, eval_max_windows=1024, ckpt_every=250),
                 max_steps=1000, routed=(16, 14, 13, 11, 9, 6, 3)),
    "gpu": Scale("exp",
                 dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=1024, ffn="moe", n_routed_experts=16, num_experts_per_tok=2,
                      moe_intermediate_size=256, shared_intermediate_size=512,
                      engram=dict(layer_ids=[1, 6], n_embed_per_ngram=256, n_head_per_ngram=4)),
                 dict(seq_len=512, batch_size=64, lr=1.5e-3, warmup_steps=150, eval_max_windows=256,
                      ckpt_every=1000),
                 max_steps=3100, routed=(16, 14, 13, 11, 9), dense_baselines=False),
    # tests: seconds per run
    "tiny": Scale("tiny", dict(ffn="moe", n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_intermediate_size=32, hc_mult=1),
                  dict(batch_size=4), max_steps=6, routed=(6, 5, 3), data=(), dense_baselines=True),
}


def _scale(scale: str | Scale) -> Scale:
    if isinstance(scale, Scale):
        return scale
    if scale not in SCALES:
        raise ConfigError(f"unknown allocation scale {scale!r}; choose one of {', '.join(SCALES)}")
    return SCALES[scale]


@dataclass
class Variant:
    """One point of the sweep: how to build it (`use_engram`, `model_overrides`) and its accounting."""

    name: str
    kind: str  # "moe", "moe+engram" or "dense"
    rho: float | None  # share of the inactive sparse budget kept by routed experts (None: dense)
    use_engram: bool
    model_overrides: dict
    accounting: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------- accounting
def _config(preset: str, overrides: dict, use_engram: bool):
    """The model config a run of this variant trains (`presets.model_for`, the trainer's own merge of
    overrides), with the preset's vocabulary and tokenizer: those are the same in every variant."""
    from engram.training.presets import get_preset, model_for

    proto = get_preset(preset).model()
    return model_for(preset, proto.vocab_size, proto.pad_token_id, proto.engram["tokenizer_name_or_path"],
                     use_engram=use_engram, overrides=overrides)


def count_params(cfg) -> dict:
    """Parameters of `cfg` by kind, counted on a meta-device model (no memory):

    total, table (Engram rows), routed (all routed experts), activated (per token: everything but
    the table and the routed experts a token skips, plus the table rows it reads), inactive.
    """
    from engram.model import EngramForCausalLM

    with torch.device("meta"):
        model = EngramForCausalLM(cfg)
    c = {"total": 0, "table": 0, "routed": 0, "embedding": 0, "engram_dense": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        c["total"] += n
        if name.endswith(TABLE_WEIGHT):
            c["table"] += n
        elif name.endswith(ROUTED_WEIGHTS):
            c["routed"] += n
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            c["embedding"] += n
        elif ".engram." in name:
            c["engram_dense"] += n
    c["rows_read"] = _rows_read(cfg) if cfg.use_engram else 0  # table parameters a token reads
    kept = cfg.num_experts_per_tok / cfg.n_routed_experts if cfg.ffn == "moe" else 1.0
    c["activated"] = c["total"] - c["table"] - c["routed"] + round(c["routed"] * kept) + c["rows_read"]
    c["inactive"] = c["total"] - c["activated"]
    return c


def flops_per_token(cfg, seq_len: int) -> float:
    """Forward FLOPs per token at `seq_len` (matmuls, attention and conv, as counted by
    `torch.utils.flop_counter` on a random-weight model; the table gather and the hashing add none)."""
    from torch.utils.flop_counter import FlopCounterMode

    from engram.model import EngramForCausalLM

    torch.manual_seed(0)
    model = EngramForCausalLM(cfg).eval()
    ids = torch.randint(2, cfg.vocab_size, (1, seq_len))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(ids)
    return fc.get_total_flops() / seq_len


def table_sizes(rows: int, n_orders: int, heads: int, layer_ids: list[int]) -> list[int]:
    """`engram_vocab_size` (one target per order) whose heads' primes add up, over all Engram
    layers, to as close to `rows` as the primes allow. The hashing gives each head the next unused
    prime above its order's target, layer by layer; with the first order's target below the
    others', order 1 takes `heads * layers` consecutive primes above its target and the other
    orders the `heads * layers * (n_orders - 1)` primes above theirs. Searches both targets and
    checks the result with the reference's own prime choice (`hashing.head_moduli`)."""
    from sympy import primerange

    from engram.hashing import head_moduli

    L = len(layer_ids)
    if rows < 4 * n_orders * heads * L:
        raise ConfigError(f"an Engram table of {rows} rows is too small for {n_orders * heads * L} heads")
    primes = np.fromiter(primerange(2, 2 * rows // (n_orders * heads * L) * 2 + 1001), dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(primes, dtype=np.int64)])

    def window(v: int, k: int) -> tuple[int, int]:  # sum of the k primes >= v, and the index after them
        i = int(np.searchsorted(primes, v, side="left"))
        return int(csum[i + k] - csum[i]), i + k

    k0, k1 = heads * L, heads * L * (n_orders - 1)
    per_head = rows / (n_orders * heads * L)
    best = (float("inf"), 0, None)  # (|error|, predicted rows, sizes)
    lo, hi = max(2, int(per_head * 0.8)), int(per_head * 1.2) + 2
    for v0 in sorted(range(lo, hi), key=lambda v: abs(v - per_head)):  # orders as equal as the primes allow
        s0, end = window(v0, k0)
        if n_orders == 1:
            cand = [(abs(rows - s0), s0, [v0])]
        else:
            tgt = max(int(primes[end - 1]) + 1, int((rows - s0) / k1) - 50)  # above the first order's primes
            cand = [(abs(rows - s0 - s1), s0 + s1, [v0] + [v1] * (n_orders - 1))
                    for v1 in range(tgt, tgt + 100) for s1 in [window(v1, k1)[0]]]
        best = min(best, min(cand))
        if best[0] <= 1:
            break
    _, predicted, sizes = best
    got = sum(sum(sum(h) for h in orders) for orders in head_moduli(layer_ids, sizes, n_orders + 1, heads).values())
    if got != predicted:  # the reference's prime choice is authoritative
        raise ConfigError(f"table sizing disagrees with the hashing's primes ({got} != {predicted} rows)")
    return sizes


def plan(scale: str | Scale = "cpu", flops_seq_len: int | None = None) -> list[Variant]:
    """The variants of a scale with their accounting. Total parameters are equal across the MoE
    variants within one row group, activated parameters within half a shared-FFN unit."""
    sc = _scale(scale)
    base = dict(sc.model)
    moe_cfg = _config(sc.preset, base, use_engram=False)
    ref = count_params(moe_cfg)
    D, L, k = moe_cfg.hidden_size, moe_cfg.num_hidden_layers, moe_cfg.num_experts_per_tok
    E0 = moe_cfg.n_routed_experts
    if sc.routed[0] != E0 or any(not k < E <= E0 for E in sc.routed[1:]):
        raise ConfigError(f"routed experts {sc.routed} must start with the pure MoE's {E0} and stay in ({k}, {E0}]")
    unit = 3 * D * L  # one unit of shared-expert width in every layer
    out = [Variant(f"moe-E{E0}", "moe", 1.0, False, base, ref)]
    for E in sc.routed[1:]:
        over = {**base, "n_routed_experts": E}
        cfg = _config(sc.preset, over, use_engram=True)
        c = count_params(cfg)
        width = cfg.shared_intermediate_size - round((c["activated"] - ref["activated"]) / unit)
        if width <= 0:
            raise ConfigError(f"Engram's dense weights exceed the shared expert's width at E={E}")
        over["shared_intermediate_size"] = width
        e = cfg.engram_config
        c = count_params(_config(sc.preset, over, use_engram=True))
        budget = ref["total"] - (c["total"] - c["table"])  # what the tables may hold
        over["engram"] = {**base.get("engram", {}), "engram_vocab_size": table_sizes(
            round(budget / e.head_dim), e.max_ngram_size - 1, e.n_head_per_ngram, e.layer_ids)}
        c = count_params(_config(sc.preset, over, use_engram=True))
        out.append(Variant(f"moe-E{E}+engram", "moe+engram", (E - k) / (E0 - k), True, over, c))
    if sc.dense_baselines:
        dense = {kk: v for kk, v in base.items() if kk not in ("n_routed_experts", "num_experts_per_tok",
                                                               "moe_intermediate_size", "shared_intermediate_size")}
        dense["ffn"] = "mlp"
        for name, key in (("dense-iso-activated", "activated"), ("dense-iso-total", "total")):
            probe = _config(sc.preset, {**dense, "intermediate_size": 1}, use_engram=False)
            width = 1 + round((ref[key] - count_params(probe)[key]) / unit)
            over = {**dense, "intermediate_size": width}
            out.append(Variant(name, "dense", None, False, over,
                               count_params(_config(sc.preset, over, use_engram=False))))
    from engram.hashing import head_moduli

    for v in out:
        a, cfg = v.accounting, _config(sc.preset, v.model_overrides, v.use_engram)
        a["embedding_share_of_activated"] = a["embedding"] / a["activated"]  # the same embedding + LM head in all
        a["ffn_width"] = cfg.shared_intermediate_size if cfg.ffn == "moe" else cfg.intermediate_size
        if v.use_engram:
            e = cfg.engram_config
            a["engram_vocab_size"] = list(e.engram_vocab_size)
            a["head_primes"] = {str(k): p for k, p in head_moduli(e.layer_ids, e.engram_vocab_size, e.max_ngram_size,
                                                                  e.n_head_per_ngram).items()}
        if flops_seq_len:
            a["flops_per_token"] = flops_per_token(cfg, flops_seq_len)
    return out


ACCOUNTING_NOTES = {
    "activated": "everything but the Engram table and the routed experts a token skips, plus the table rows it "
                 "reads (heads x head_dim per Engram layer); includes the token embedding and LM head, which are "
                 "the same in every variant (embedding_share_of_activated)",
    "ffn_width": "MoE variants: the shared expert's width, narrowed to pay for Engram's dense weights; dense "
                 "baselines: the SwiGLU width",
    "head_primes": "the prime row count of every head, {layer: [[order 2 heads], [order 3 heads]]}",
    "flops_per_token": "forward FLOPs per token from torch.utils.flop_counter at the training sequence length: "
                       "matmuls, attention and the conv; it counts neither the n-gram hashing (integer "
                       "multiply-XOR-mod on the host, 8 heads per token) nor the table gather (memory reads)",
    "tokens_per_row": "training tokens x rows read per token / table rows: how often a row is read in training",
}


def _rows_read(cfg) -> int:
    """Table parameters one token reads: one row per head of every Engram layer."""
    e = cfg.engram_config
    return len([i for i in e.layer_ids if i < cfg.num_hidden_layers]) * e.num_heads * e.head_dim


def row_group(v: Variant, scale: str | Scale = "cpu") -> int:
    """Parameters of one row in every head of every Engram layer (the table's size granularity)."""
    sc = _scale(scale)
    cfg = _config(sc.preset, v.model_overrides, True)
    return _rows_read(cfg)


# ------------------------------------------------------------------------------------------ running
def _train(run_dir: Path, sc: Scale, v: Variant, seed: int, max_steps: int, data, progress: bool) -> dict:
    return trained_run(run_dir, f"[allocation] {v.name}", seed, sc.preset, data=data, max_steps=max_steps,
                       progress=progress, overrides=sc.train, use_engram=v.use_engram,
                       model_overrides=v.model_overrides)


def close_neighbours(table: dict, order: list[str]) -> set[str]:
    """Variants adjacent in `rho` whose means differ by less than two spreads (the larger of the two)."""
    out = set()
    for a, b in zip(order, order[1:]):
        ta, tb = table[a], table[b]
        if abs(ta["mean"] - tb["mean"]) < 2 * max(ta["spread"], tb["spread"]):
            out |= {a, b}
    return out


def run(out: str | Path = "runs/experiments", seeds: int = 2, max_steps: int | None = None, progress: bool = True,
        scale: str = "cpu", data: list[str] | None = None, third_seed: bool = True, plan_only: bool = False,
        record: str | Path | None = None, only: list[str] | None = None, finished_only: bool = False) -> dict:
    """Train the sweep (resumable) and write accounting.json, summary.json, summary.md, plot.png.
    `plan_only`: write and print the accounting, train nothing. `only`: train these variants (names from the
    plan) for `seeds` seeds and report the others' finished runs only. `finished_only`: train nothing.
    `record`: also write `record/allocation-accounting.json` and the per-seed results `record/allocation.json`."""
    from engram.training.presets import train_config

    from .records import recorded_runs

    sc = _scale(scale)
    root = Path(out) / "allocation" if scale == "cpu" else Path(out) / f"allocation-{scale}"
    root.mkdir(parents=True, exist_ok=True)
    steps = max_steps or sc.max_steps
    tcfg = train_config(sc.preset, sc.train, steps)
    data = list(data or sc.data) or None
    vs = plan(sc, flops_seq_len=tcfg.seq_len)  # (seconds; finished runs of unchanged variants are reused)
    tokens = steps * tcfg.batch_size * tcfg.seq_len
    for v in vs:  # a token reads rows_read / head_dim rows of the table's table / head_dim
        a = v.accounting
        a["tokens"] = tokens
        a["tokens_per_row"] = tokens * a["rows_read"] / a["table"] if a["table"] else None
    accounting = {"scale": scale, "notes": ACCOUNTING_NOTES, "variants": [dataclasses.asdict(v) for v in vs]}
    write_json(root / "accounting.json", accounting)
    if record is not None:
        write_json(Path(record) / f"{root.name}-accounting.json", accounting)
    if progress:
        print(accounting_markdown(vs))
    if plan_only:
        return {"experiment": "allocation", "scale": scale, "accounting": [dataclasses.asdict(v) for v in vs]}
    names = [v.name for v in vs]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ConfigError(f"unknown allocation variant(s) {', '.join(unknown)}; "
                          f"the {scale} plan has {', '.join(names)}")
    results: dict[str, list[dict]] = {v.name: [] for v in vs}
    # `--variants` adding seeds to a committed record: the (variant, seed) runs it holds are not trained again
    # (their recorded values and environments are kept); runs finished under OUT take precedence over them
    recorded = recorded_runs(Path(record) / "allocation.json") if record is not None and only is not None else {}
    for seed in range(seeds):
        for v in vs:
            run_dir = root / f"{v.name}-seed{seed}"
            old = next((r for r in recorded.get(v.name, []) if r["seed"] == seed), None)
            train_it = not finished_only and (only is None or v.name in only) and old is None
            if train_it or (run_dir / "summary.json").is_file():
                results[v.name].append(_train(run_dir, sc, v, seed, steps, data, progress))
            elif old is not None:
                results[v.name].append(old)
    if only is not None or finished_only:  # seeds beyond `seeds` that finished (or were recorded) earlier count too
        for v in vs:
            seed = seeds
            while (root / f"{v.name}-seed{seed}" / "summary.json").is_file():
                results[v.name].append(_train(root / f"{v.name}-seed{seed}", sc, v, seed, steps, data, progress))
                seed += 1
            results[v.name] += [r for r in recorded.get(v.name, []) if r["seed"] >= seed]
        third_seed = False
    vs = [v for v in vs if results[v.name]]
    results = {n: rs for n, rs in results.items() if rs}
    if not vs:
        raise ConfigError(f"no finished allocation runs under {root}")
    table = {n: seed_stats([r["val_loss"] for r in rs]) for n, rs in results.items()}
    sweep = [v.name for v in sorted((v for v in vs if v.rho is not None), key=lambda v: v.rho)]
    if not sweep or sweep[-1] != names[0]:
        raise ConfigError(f"the pure MoE ({names[0]}) has no finished run: every comparison needs it")
    while third_seed and seeds == 2:  # until no point with 2 seeds is within two spreads of a neighbour
        more = [v for v in vs if v.name in close_neighbours(table, sweep) and len(results[v.name]) == 2]
        if not more:
            break
        for v in more:
            results[v.name].append(_train(root / f"{v.name}-seed2", sc, v, 2, steps, data, progress))
        table = {n: seed_stats([r["val_loss"] for r in rs]) for n, rs in results.items()}
    best = min(sweep[:-1], key=lambda n: table[n]["mean"]) if len(sweep) > 1 else sweep[0]
    summary = {"experiment": "allocation", "scale": scale, "steps": steps, "tokens": tokens,
               "seeds": {n: len(rs) for n, rs in results.items()},
               "variants": {v.name: {"kind": v.kind, "rho": v.rho, **table[v.name], "accounting": v.accounting}
                            for v in vs},
               "best_engram": best, "pure_moe": sweep[-1]}
    write_json(root / "summary.json", summary)
    if record is not None:
        from .records import record_experiment

        rec_table = {v.name: table[v.name] | {"rho": v.rho, "params": v.accounting["total"],
                                              "activated": v.accounting["activated"],
                                              "table_params": v.accounting["table"]}
                     for v in vs}
        command = (f"engram experiment allocation --seeds {seeds} --record {record}"
                   + (f" --variants {','.join(only)}" if only else ""))
        if any(r.get("recorded") for rs in results.values() for r in rs):  # the record this one extends
            command = f"{read_result(Path(record) / 'allocation.json', 'experiment record')['command']}; then {command}"
        record_experiment(Path(record) / "allocation.json",
                          {"experiment": "allocation", "preset": sc.preset, "seeds": seeds, "variants": rec_table},
                          results, command=command)
    md = accounting_markdown(vs) + "\n" + results_markdown(vs, table, best, sweep[-1])
    atomic_write_bytes(root / "summary.md", md.encode())
    _plot(vs, table, root / "plot.png", scale)
    if progress:
        print(md)
    return summary


# ------------------------------------------------------------------------------------------ reports
def accounting_markdown(vs: list[Variant]) -> str:
    """The accounting table of the plan `vs` (`accounting_table`, which also renders the committed one)."""
    return accounting_table([dataclasses.asdict(v) for v in vs])


def accounting_table(vs: list[dict]) -> str:
    """The allocation sweep's accounting table from its variants (`allocation.Variant` as dicts: what
    `experiment allocation --plan-only --record` writes to allocation-accounting.json)."""
    lines = ["| variant | rho (MoE share) | routed experts | shared expert / FFN width | total params | activated "
             "(embedding + LM head share) | table params | FLOPs/token (fwd, no hashing or gather) | tokens per row |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in vs:
        a = v["accounting"]
        E = v["model_overrides"].get("n_routed_experts", "-") if v["kind"] != "dense" else "-"
        rho = f"{100 * v['rho']:.1f}%" if v["rho"] is not None else "-"
        fl = f"{a['flops_per_token'] / 1e6:.3f}M" if "flops_per_token" in a else "-"
        tpr = f"{a['tokens_per_row']:,.0f}" if a.get("tokens_per_row") else "-"
        share = f" ({a['embedding_share_of_activated']:.0%})" if "embedding_share_of_activated" in a else ""
        lines.append(f"| {v['name']} | {rho} | {E} | {a.get('ffn_width', '-')} | {a['total']:,} | "
                     f"{a['activated']:,}{share} | {a['table']:,} | {fl} | {tpr} |")
    return "\n".join(lines) + "\n"


def results_markdown(vs: list[Variant], table: dict, best: str, moe: str) -> str:
    lines = ["| variant | rho | seeds | final val loss (mean ± half-range) | vs pure MoE |", "|---|---|---|---|---|"]
    for v in vs:
        t = table[v.name]
        rho = f"{100 * v.rho:.1f}%" if v.rho is not None else "-"
        mark = " (best)" if v.name == best else ""
        lines.append(f"| {v.name}{mark} | {rho} | {len(t['values'])} | {t['mean']:.4f} ± {t['spread']:.4f} | "
                     f"{t['mean'] - table[moe]['mean']:+.4f} |")
    return "\n".join(lines) + "\n"


def _plot(vs: list[Variant], table: dict, path: Path, scale: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    pts = sorted((100 * v.rho, table[v.name]) for v in vs if v.rho is not None)
    ax.errorbar([p for p, _ in pts], [t["mean"] for _, t in pts], yerr=[t["spread"] for _, t in pts], fmt="o-",
                capsize=3, label="MoE + Engram (fixed total and activated params)")
    for p, t in pts:
        ax.scatter([p] * len(t["values"]), t["values"], s=8, color="gray", alpha=0.6)
    for v, style in zip((v for v in vs if v.kind == "dense"), ("--", ":")):
        ax.axhline(table[v.name]["mean"], color="gray", ls=style, label=v.name)
    ax.set_xlabel("rho: share of the inactive sparse budget kept by routed experts (%)")
    ax.set_ylabel("final val loss")
    ax.set_title(f"engram experiment allocation ({scale})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _runs(design: dict, recs: dict):
    """`allocation-replication`'s runs: the plan at the design's `scale` (each variant's model overrides and Engram
    use, the scale's training overrides, data and steps: `_train`'s), with `run`'s record table."""
    from .preset import preset_trainer
    from .runs import ExperimentError

    sc = _scale(design.get("scale", "cpu"))
    if sc.preset != design.get("preset"):
        raise ExperimentError(f"allocation's {design.get('scale', 'cpu')} scale trains preset {sc.preset!r}, "
                              f"not {design.get('preset')!r}")
    points = {v.name: v for v in plan(sc)}

    def table(results: dict) -> dict:  # `run`'s record table
        return {n: seed_stats([r["val_loss"] for r in rs]) | {
            "rho": points[n].rho, "params": points[n].accounting["total"],
            "activated": points[n].accounting["activated"], "table_params": points[n].accounting["table"]}
            for n, rs in results.items()}

    vs = {n: {"overrides": dict(sc.train), "use_engram": v.use_engram, "model_overrides": v.model_overrides}
          for n, v in points.items()}
    data = list(sc.data) or None
    return Runs(vs, table, preset_trainer("allocation", vs, data, sc.max_steps), data, sc.max_steps)


def _plot_record(rec: dict, path: Path) -> None:
    from .records import plot_bars

    plot_bars(rec, path)


register(Experiment("allocation", """
    the paper's U-curve: total and activated parameters fixed, the share of the inactive
    sparse budget kept by routed MoE experts swept from 100% down, the rest as Engram rows;
    plus dense iso-activated and iso-total baselines (`allocation.py`;
    `--scale gpu` for the larger sweep of `experiments/allocation_gpu.sh`).""",
                    run=lambda o: run(o.out, o.seeds, o.max_steps, progress=o.progress, scale=o.scale, data=o.data,
                                      plan_only=o.plan_only, record=o.record, only=o.variants_only,
                                      finished_only=o.finished_only),
                    plot=_plot_record, plot_file="exp-allocation-4seeds.png", baseline="moe-E16", replication=_runs,
                    section="10"))
# the records allocation's commands write besides its own: the accounting (`--plan-only --record`) and the sweep
# kept as summary statistics (quoted means and half-ranges)
register(Experiment("allocation-accounting", "the sweep's accounting table (`engram experiment allocation --plan-only "
                    "--record`)", table=lambda rec: accounting_table(rec["variants"]), section="10"))
register(Experiment("allocation-sweep", "the sweep's summary statistics, quoted from runs whose per-seed values were "
                    "not kept", baseline="moe-E16", section="10"))
