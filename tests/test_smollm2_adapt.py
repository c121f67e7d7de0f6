"""`engram experiment smollm2-adapt`'s page (issue 59 item 4): the selection seed's table gives every (method, lr) point
its three measures and marks the dominated ones, on the committed record (the experiment itself runs SmolLM2 for
about 70 min: `engram experiment smollm2-adapt`)."""

import json
from pathlib import Path

from engram_experiments import smollm2_adapt as sa

RECORD = Path(__file__).resolve().parents[1] / "docs/results/smollm2-adapt.json"


def _pt(domain, general, shared):
    return {"domain_val": domain, "forgetting_general": general, "forgetting_shared": shared}


def test_a_point_is_dominated_when_another_is_as_low_on_all_three_and_lower_on_one():
    pts = [_pt(3.0, 0.1, 0.1), _pt(3.0, 0.1, 0.1), _pt(3.1, 0.1, 0.1), _pt(2.9, 0.2, 0.0), _pt(3.2, 0.3, 0.2)]
    by = sa.dominated_by(pts)
    assert by[0] == [] and by[1] == []  # equal on all three: neither dominates the other
    assert by[2] == [0, 1]  # as low on two, higher domain loss
    assert by[3] == []  # lowest domain loss, more general forgetting: on the front
    assert by[4] == [0, 1, 2, 3]


def test_the_selection_table_shows_all_three_measures_and_marks_the_dominated_points():
    s = json.loads(RECORD.read_text(encoding="utf-8"))
    sel = s["design"]["selection"]["seed"]
    runs = [r for r in s["runs"] if r["seed"] == sel]
    md = sa.markdown(s)
    lines = md.splitlines()
    head = lines.index("| method | lr | domain val loss | forgetting (general) | forgetting (shared n-grams) | "
                       "dominated by |")
    rows = lines[head + 2:head + 2 + len(runs)]
    assert len(rows) == len(runs) and all(r.startswith("| ") for r in rows)
    by = sa.dominated_by([r for m in s["methods"] for r in sorted((r for r in runs if r["method"] == m),
                                                                  key=lambda r: r["lr"])])
    assert sum(1 for r in rows if " † |" in r) == sum(1 for d in by if d) > 0
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        table[cells[1].removesuffix(" †"), cells[2].strip("*")] = cells
    assert len(table) == len(runs)
    for r in runs:  # each run's three measures, at the row of its method and lr
        lr = f"{r['lr']:g}"
        cells = table[r["method"], lr]
        assert cells[3:6] == [f"{r['domain_val']:.4f}", f"{r['forgetting_general']:+.4f}",
                              f"{r['forgetting_shared']:+.4f}"]
        assert (cells[2] == f"**{lr}**") == (s["chosen"][r["method"]]["lr"] == r["lr"])
    # the reviewer's reading (issue 59): full fine-tuning at its lowest lr beats every Engram point on all three
    full = min((r for r in runs if r["method"] == "full"), key=lambda r: r["lr"])
    for row in rows:
        if row.startswith(("| engram † |", "| engram-matched † |")):
            assert f"full {full['lr']:g}" in row.split("|")[6]
    assert "every point of engram and engram-matched is dominated" in md
    assert "† marks a dominated point" in md
