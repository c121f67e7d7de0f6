"""`engram gates`: where does the memory open? Token-level gate heatmaps (PNG, HTML, terminal).

One row per (Engram layer, stream), one column per token, the decoded token text underneath,
as in the paper's gate figure. The HTML page is self-contained: hovering a token shows its gate
for every layer and stream. `gate_summary` compares the mean gate on tokens that complete
frequent train-split n-grams (names, set phrases) with the mean gate on function words.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import torch

from ..persist import atomic_write_bytes
from ..placement import model_device
from ..tokenizer import load_tokenizer
from ..training.data import eval_windows, load_manifest, load_split
from ..training.run import read_run_file
from .stats import frequent_ngram_mask

FUNCTION_WORDS = set("""a an the and or but if of to in on at by for with from as is are was were be been am it its
this that these those he she they we you i me him her them us my his their our your not no so than then there
here what which who whom whose when where why how all any some do does did have has had will would shall should
can could may might must o thee thou thy thine""".split())


def model_gates(model, ids: torch.Tensor) -> dict:
    """{layer: (B, T, G) gates} of one forward over `ids` (B, T): an engram model's own (`return_gates=True`), or,
    on a pretrained model with an Engram adapter attached, the adapter's (recorded while `adapter.gates` is a dict;
    G = 1)."""
    from ..adapters.hooks import adapter_of

    ad = adapter_of(model)  # (None on an engram model)
    with torch.no_grad():
        if ad is None:
            return dict(model(ids, return_gates=True).gates)
        ad.gates = {}
        try:
            model(input_ids=ids, use_cache=False)
            return {k: v.unsqueeze(-1) for k, v in ad.gates.items()}  # (B, T) -> (B, T, 1)
        finally:
            ad.gates = None


def compute_gates(model, tokenizer, text: str):
    """(tokens [T] as text, gates {layer: np.ndarray (T, G)}) for one text."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    if not enc.ids:
        raise ValueError("--text is empty after tokenization")
    ids = torch.tensor([enc.ids], device=model_device(model))
    gates = {int(k): v[0].float().cpu().numpy() for k, v in model_gates(model, ids).items()}
    if not gates:
        raise ValueError("this checkpoint has no Engram layers (trained with --no-engram?)")
    tokens = [tokenizer.decode([i]) for i in enc.ids]
    return tokens, gates


def _rows(gates: dict) -> tuple[list[str], np.ndarray]:
    labels, rows = [], []
    for layer in sorted(gates):
        g = gates[layer]  # (T, G)
        for s in range(g.shape[1]):
            labels.append(f"L{layer}" + (f" s{s}" if g.shape[1] > 1 else ""))
            rows.append(g[:, s])
    return labels, np.stack(rows)


def save_png(tokens: list[str], gates: dict, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, M = _rows(gates)
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(tokens) + 1.5), 0.45 * len(labels) + 1.6))
    im = ax.imshow(M, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(len(tokens)), [t.replace("\n", "\\n") for t in tokens], rotation=60, ha="right", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, label="gate")
    ax.set_title(title or "Engram gate per token")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def save_html(tokens: list[str], gates: dict, path: Path, title: str = "Engram gates") -> Path:
    labels, M = _rows(gates)
    mean = M.mean(axis=0)
    spans = []
    for t, tok in enumerate(tokens):
        detail = {lab: round(float(M[r, t]), 4) for r, lab in enumerate(labels)}
        alpha = float(mean[t])
        spans.append(
            f'<span class="tok" style="background: rgba(220,40,40,{alpha:.3f})" '
            f'data-gates=\'{html.escape(json.dumps(detail))}\' '
            f'title="{html.escape(" ".join(f"{k}={v:.3f}" for k, v in detail.items()))}">'
            f"{html.escape(tok).replace(' ', '&nbsp;') or '&#8203;'}</span>")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
.tok {{ font-family: monospace; font-size: 18px; padding: 2px 1px; border-radius: 3px; cursor: default; }}
#info {{ margin-top: 1.5em; font-family: monospace; min-height: 4em; white-space: pre; }}
</style></head>
<body><h2>{html.escape(title)}</h2>
<p>Background = mean gate over layers and streams; hover a token for each layer and stream.</p>
<div id="text">{''.join(spans)}</div>
<div id="info">hover a token</div>
<script>
document.querySelectorAll('.tok').forEach(function (el) {{
  el.addEventListener('mouseenter', function () {{
    var g = JSON.parse(el.dataset.gates), lines = ['token ' + JSON.stringify(el.textContent)];
    for (var k in g) lines.push(k + ': ' + g[k].toFixed(3));
    document.getElementById('info').textContent = lines.join('\\n');
  }});
}});
</script></body></html>
"""
    atomic_write_bytes(Path(path), page.encode("utf-8"))
    return Path(path)


def save(tokens: list[str], gates: dict, path: Path, title: str = "") -> Path:
    """A heatmap file: `.html` (hoverable) or `.png`, by the file name."""
    path = Path(path)
    if path.suffix == ".html":
        return save_html(tokens, gates, path, title=f"Engram gates: {title[:60]}")
    if path.suffix == ".png":
        return save_png(tokens, gates, path, title=title[:80])
    raise ValueError(f"--out {path}: use a .png or .html file name")


_RAMP = (231, 224, 217, 210, 203, 196)


def terminal(tokens: list[str], gates: dict) -> str:
    """ANSI-colored rendering: one line per Engram layer, background intensity = mean gate over streams."""
    lines = []
    for layer in sorted(gates):
        g = gates[layer].mean(axis=1)
        parts = []
        for tok, v in zip(tokens, g):
            level = min(5, int(float(v) * 6))  # white -> red ramp of the 256-color palette
            parts.append(f"\x1b[48;5;{_RAMP[level]}m\x1b[30m{tok}\x1b[0m")
        lines.append(f"L{layer}: " + "".join(parts))
    lines.append("(darker red = higher gate)")
    return "\n".join(lines)


def gate_summary(model, data_dir: Path, seq_len: int = 128, max_windows: int = 32) -> dict:
    """Mean gate on frequent-n-gram completions vs function words over the val split."""
    manifest = load_manifest(data_dir)
    tok = load_tokenizer(manifest["tokenizer_file"])
    windows = eval_windows(load_split(data_dir, "val"), seq_len, max_windows)
    ent = frequent_ngram_mask(np.asarray(load_split(data_dir, "train")), windows)
    vocab_fn = np.zeros(manifest["vocab_size"], dtype=bool)
    for i in range(manifest["vocab_size"]):
        if tok.decode([i]).strip().lower() in FUNCTION_WORDS:
            vocab_fn[i] = True
    fn = vocab_fn[windows] & ~ent
    res = {}
    for layer, g in model_gates(model, torch.from_numpy(windows).to(model_device(model))).items():
        gm = g.float().mean(-1).cpu().numpy()  # (N, T)
        res[int(layer)] = {"entity_completion": float(gm[ent].mean()), "function_words": float(gm[fn].mean()),
                           "all": float(gm.mean()), "n_entity": int(ent.sum()), "n_function": int(fn.sum())}
    return res


def run_gate_summary(model, checkpoint: Path) -> dict:
    """`gate_summary` on the val split of the run that produced `checkpoint` (a run dir or its final/)."""
    p = Path(checkpoint)
    run = p if (p / "run.json").is_file() else p.parent
    if not (run / "run.json").is_file():
        raise ValueError("--summary needs a run directory (with run.json) to find the val split")
    info = read_run_file(run)
    return gate_summary(model, Path(info["data_dir"]), info["train"]["seq_len"])
