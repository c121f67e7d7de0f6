"""Hundreds of overlays resident: resident memory per loaded overlay against its bytes on disk, in the vLLM plugin's
`OverlayBank` and in `engram serve` (through its `POST /v1/load_overlay`).

Model: the tests' tiny run (`engram train tiny`, 10 steps on tests/conftest.py's 400-line corpus,
`bench_edit_scale.tiny_checkpoint`), unless `--checkpoint` names one. Overlays: `--overlays` (500) made by the
editing API (`edit_facts`, `--steps` Adam steps: the rows an overlay holds are the rows its facts address, whatever
the values), each of `--facts` (20) distinct generated facts ("The king sat on Line N" -> " dog"), saved as `engram
edit` saves them. Each part runs in a fresh interpreter that loads the model, reads its resident memory (VmRSS, as
`bench_dtype.status_kib`; the peak through `engram.utils.reset_peak_rss` / VmHWM), loads every overlay one by one,
and reads it again:

  * bank: `integrations.vllm.overlays.OverlayBank.load` (each folder checked against the model as at startup, then
    merged into the bank's sorted keys and values: what a vLLM worker does for `POST /v1/load_overlay`);
  * serve: `engram serve`'s app (`serving.app.create_app(..., allow_overlay_updates=True)`, driven in process with
    FastAPI's TestClient), one `POST /v1/load_overlay` per overlay, then one completion naming the last.

Prints, per part: MiB of resident growth, KiB per overlay, the ratio to an overlay's bytes on disk (its weights
file, `overlay.safetensors`: row ids and values) and to the bank's own tensors, and the seconds per load; then one
JSON line; `--record FILE` appends it, with the environment, to a JSON record.

    OMP_NUM_THREADS=1 python benchmarks/bench_overlay_bank.py [--overlays 500] [--facts 20] [--steps 1]
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import append_run
from bench_dtype import status_kib
from bench_edit_scale import tiny_checkpoint


def make_overlays(ckpt: Path, out: Path, n: int, facts: int, steps: int, fact=None) -> list[Path]:
    """`n` overlay folders of `facts` facts each, made by `edit_facts` on the model at `ckpt`; `fact(k, i)` ->
    (prompt, target) is overlay k's fact i (default: distinct generated facts, "The king sat on Line N")."""
    from engram.editing import Fact, edit_facts
    from engram.inference import load_inference_model

    model, tok = load_inference_model(ckpt)
    dirs = []
    for k in range(n):
        fs = [Fact(*fact(k, i)) if fact else Fact(f"The king sat on Line {k * facts + i}", " dog" if i % 2 else
                                                  " the king") for i in range(facts)]
        dirs.append(edit_facts(model, tok, fs, steps=steps, progress=False).save(out / f"o{k}"))
    return dirs


def child(part: str, ckpt: str, dirs: list[str]) -> dict:
    """Load the model, then every overlay into `part` ("bank" or "serve"); resident memory before and after."""
    from engram.utils import reset_peak_rss

    if part == "bank":
        from engram.editing import engram_layers, model_digest
        from engram.inference import load_inference_model
        from engram.integrations.vllm.overlays import OverlayBank

        model, _ = load_inference_model(ckpt)
        bank = OverlayBank(engram_layers(model), {}, model=model, digest=model_digest(model))
        load = bank.load
    else:
        from fastapi.testclient import TestClient

        from engram.serving import load_engine
        from engram.serving.app import create_app

        engine = load_engine(ckpt, name="m")
        client = TestClient(create_app(engine, allow_overlay_updates=True))

        def load(name, d):
            r = client.post("/v1/load_overlay", json={"overlay_name": name, "overlay_path": d})
            assert r.status_code == 200, r.text
    load("warm", dirs[0])  # (everything imported and allocated once, outside the measure)
    if part == "bank":
        bank.unload("warm")
    else:
        client.post("/v1/unload_overlay", json={"overlay_name": "warm"})
    gc.collect()
    peak_ok = reset_peak_rss()
    rss0 = status_kib("VmRSS")
    t0 = time.perf_counter()
    times = []
    for k, d in enumerate(dirs):
        t = time.perf_counter()
        load(f"o{k}", d)
        times.append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    gc.collect()
    rss1 = status_kib("VmRSS")
    out = {"part": part, "overlays": len(dirs), "rss_mib": round((rss1 - rss0) / 1024, 2),
           "peak_mib": round((status_kib("VmHWM") - rss0) / 1024, 2) if peak_ok else None,
           "load_s_median": round(statistics.median(times), 4), "load_s_total": round(seconds, 2)}
    if part == "bank":
        out["bank_bytes"] = sum(t.numel() * t.element_size() for t in [*bank.keys.values(), *bank.values.values()])
        out["rows"] = bank.num_rows
    else:
        r = client.post("/v1/completions", json={"model": f"m+o{len(dirs) - 1}", "prompt": "The king sat on",
                                                 "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        out["served_ids"] = len(client.get("/v1/models").json()["data"])
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overlays", type=int, default=500)
    ap.add_argument("--facts", type=int, default=20, help="facts per overlay")
    ap.add_argument("--steps", type=int, default=1, help="edit_facts steps per overlay (the rows do not depend on it)")
    ap.add_argument("--checkpoint", help="an engram run or model folder (default: train the tiny one)")
    ap.add_argument("--parts", nargs="+", default=["bank", "serve"], choices=("bank", "serve"))
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    ap.add_argument("--child", nargs=2, metavar=("PART", "ARGS_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        a = json.loads(args.child[1])
        print(json.dumps(child(args.child[0], a["ckpt"], a["dirs"])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(tmp)
        t0 = time.perf_counter()
        dirs = make_overlays(ckpt, tmp / "ov", args.overlays, args.facts, args.steps)
        made_s = time.perf_counter() - t0
        disk = [(d / "overlay.safetensors").stat().st_size for d in dirs]
        folder = [sum(f.stat().st_size for f in d.iterdir() if f.is_file()) for d in dirs]
        per_disk = statistics.mean(disk)
        print(f"{len(dirs)} overlays of {args.facts} facts made in {made_s:.0f} s; on disk per overlay: weights "
              f"{per_disk / 1024:.1f} KiB, whole folder {statistics.mean(folder) / 1024:.1f} KiB", flush=True)
        parts = []
        for part in args.parts:
            p = subprocess.run([sys.executable, __file__, "--child", part,
                                json.dumps({"ckpt": str(ckpt), "dirs": [str(d) for d in dirs]})],
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"the {part} part failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["kib_per_overlay"] = round(r["rss_mib"] * 1024 / len(dirs), 2)
            r["rss_per_overlay_over_disk"] = round(r["rss_mib"] * 2**20 / len(dirs) / per_disk, 2)
            if "bank_bytes" in r:
                r["bank_over_disk"] = round(r["bank_bytes"] / sum(disk), 3)
            parts.append(r)
            print(f"{part:<5}: resident +{r['rss_mib']:.1f} MiB for {len(dirs)} overlays = {r['kib_per_overlay']:.1f} "
                  f"KiB each, {r['rss_per_overlay_over_disk']}x its weights on disk"
                  + (f" (the bank's tensors: {r['bank_over_disk']}x)" if "bank_over_disk" in r else "")
                  + f"; peak +{r['peak_mib']} MiB; {r['load_s_median'] * 1000:.1f} ms per load (median)", flush=True)
    out = {"model": str(args.checkpoint or "the tiny preset, 10 steps"), "overlays": args.overlays,
           "facts": args.facts, "steps": args.steps, "disk_bytes_mean": round(per_disk),
           "folder_bytes_mean": round(statistics.mean(folder)), "made_s": round(made_s, 1), "parts": parts}
    print(json.dumps(out))
    if args.record:
        append_run(args.record,
                   "python benchmarks/bench_overlay_bank.py [--overlays 500] [--facts 20] [--steps 1]", out)


if __name__ == "__main__":
    main()
