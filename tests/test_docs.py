"""The code shown in the docs runs as written."""

import re
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_tables_doc_snippet_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "tables.md").read_text()
    code = re.search(r"## In code\n\n```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "snippet.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "snippet.py"))
    assert (tmp_path / "train_tables" / "engram_table_L1.safetensors.journal").is_file()


def test_readme_use_it_snippet_runs():
    """The README's first code block: hash, look up the layer's rows, run the math (the tutorial's sizes)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Use it\n\n```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert tuple(ns["rows"].shape) == (1, 4, 16, 64)
    assert tuple(ns["delta"].shape) == (1, 4, 4, 1024) and tuple(ns["gate"].shape) == (1, 4, 4)


def script_commands(script: str, marker: str, step: str = r'step "(.*)"') -> list[str]:
    """The commands `script` (in scripts/) runs between its `# MARKER:begin` / `# MARKER:end` lines, each line
    matching `step` (its one group the command as bash writes it), as bash reads them."""
    text = (ROOT / "scripts" / script).read_text()
    body = text.split(f"# {marker}:begin\n", 1)[1].split(f"# {marker}:end", 1)[0]
    out = []
    for line in body.splitlines():
        m = re.fullmatch(step, line.strip())
        assert m, f"{script}: not a step line between the markers: {line!r}"
        out.append(re.sub(r'\\(["$\\])', r"\1", m.group(1)))  # bash's double-quote escapes
    return out


def test_the_smollm2_tutorials_commands_are_the_scripts():
    """docs/tutorial-smollm2.md shows exactly the commands scripts/tutorial_smollm2.sh runs (and times), in order."""
    text = (ROOT / "docs" / "tutorial-smollm2.md").read_text()
    block = re.search(r"## The commands\n\n```bash\n(.*?)```", text, re.S).group(1)
    assert block.strip().splitlines() == script_commands("tutorial_smollm2.sh", "tutorial")


def test_the_readmes_commands_are_the_scripts():
    """Every command of the README's shell blocks, in order, is what scripts/readme_commands.sh runs from a clean
    clone (so the README's commands run as written; the script is run by hand, its timings on stderr)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    readme = [line for b in blocks for line in b.splitlines() if line.strip()]
    assert readme == script_commands("readme_commands.sh", "readme",  # (a serve_step, a step it may skip)
                                     r'(?:\[ -n "\$\{README_SKIP_TESTS:-\}" \] \|\| )?(?:serve_)?step "(.*)"')



def test_every_docs_page_passes_the_number_guard():
    """Every page under docs/ and the README's template (`report.guarded_pages`): no measured number that no record
    renders and no principled exemption covers (`report.not_measurements`, `report.code_remainder`)."""
    from engram_experiments import report

    found = report.guard_pages(ROOT)
    assert not found, "\n".join(f"{p.relative_to(ROOT)}:{u.line}: {u.why}" for p, u in found)


def test_a_pending_page_still_needs_its_pass():
    """`report.PENDING` lists pages the guard skips for now; one that passes must leave the list."""
    from engram_experiments import report

    for page in report.PENDING:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert report.unsourced_numbers(text, rendered=False), f"{page} passes the guard: remove it from PENDING"


def test_the_guard_flags_a_number_typed_into_any_page(tmp_path):
    """A new page (not a template) with a typed timing, a size, a ratio or a loss fails; its exempt numbers pass."""
    from engram_experiments import report

    (tmp_path / "docs" / "results").mkdir(parents=True)
    ok = ("Install torch 2.13 and `vllm==0.32.0`; run `engram train --steps 50 --set lr=3e-3` (tested within 1e-5,\n"
          "target >= 0.97, blocks of 4 KiB, §12, issue 60, 2026-12-05, Apache-2.0). The released table holds\n"
          "51.2B parameters, ~100 GB in bf16 (cited: its config).\n")
    page = tmp_path / "docs" / "new.md"
    page.write_text(ok, encoding="utf-8")
    assert report.guard_pages(tmp_path) == []
    for bad in ("Startup takes 28 s.", "It uses 1.91 GiB.", "Prefill runs at 1.3x.", "val loss 4.62",
                "hit rate 41%", "`val_loss=0.46`", "{{value:iso/x}}"):
        page.write_text(ok + bad + "\n", encoding="utf-8")
        found = report.guard_pages(tmp_path)
        assert [(p.name, u.line) for p, u in found][:1] == [("new.md", 4)], bad
