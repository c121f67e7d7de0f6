"""The experiments' one interface (`engram_experiments.registry`): every experiment registered by name with what the
commands and the pages need, and no code that branches on an experiment's name."""

import ast
from pathlib import Path

import pytest

pytest.importorskip("engram_experiments")

from engram.config import ConfigError  # noqa: E402
from engram_experiments import preset, registry, replication  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "engram_experiments"
RESULTS = ROOT / "docs" / "results"


def test_every_experiment_is_registered_once_in_the_order_all_runs_them():
    from engram_experiments import smollm2_edit  # noqa: F401  (imported first: the order is the catalog's anyway)

    names = registry.names()
    assert len(names) == len(set(names)) and names[:6] == ["iso", "placement", "capacity", "ablations",
                                                           "sensitivity", "design"]
    assert {"retrofit", "edit", "allocation", "adapter-init", "smollm2-adapt", "smollm2-edit"} <= set(names)
    for name in names:
        exp = registry.get(name)
        assert exp.name == name and exp.help.strip() and callable(exp.run)


def test_an_unknown_experiment_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError, match="unknown experiment 'nope'; choose one of iso, placement") as e:
        registry.get("nope")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown experiment 'stats'"):  # a record kind, not runnable
        registry.get("stats")


def test_a_second_registration_of_a_name_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.Experiment("iso", "again"))


def test_each_committed_record_of_an_experiment_has_its_section_and_plot():
    """What `engram results` renders for an experiment's record: the section named by `section` exists on the
    results page's template, and its `plot_file` is among the committed images."""
    page = (ROOT / "docs" / "results.in.md").read_text(encoding="utf-8")
    for rec in sorted(RESULTS.glob("*.json")):
        exp = registry.find(rec.stem)
        if exp is None:
            continue
        if exp.section is not None:
            assert f"\n## {exp.section}. " in page, f"{rec.stem}: no section {exp.section} in docs/results.in.md"
        if exp.plot_file is not None:
            assert (ROOT / "docs" / "img" / exp.plot_file).is_file(), f"{rec.stem}: no docs/img/{exp.plot_file}"


def test_the_replicable_experiments_are_those_with_a_replication():
    assert registry.replicable() == ["ablations", "sensitivity", "retrofit", "edit", "allocation"]
    for f in sorted((ROOT / "docs" / "prereg").glob(f"*{replication.SUFFIX}.toml")):
        assert f.stem.removesuffix(replication.SUFFIX) in registry.replicable(), f.name


def test_a_preset_design_is_its_variants():
    vs = preset.variants("capacity", "tiny", "small")
    assert list(vs) == ["rows1", "rows11", "rows1009", "no-engram"]
    assert vs["no-engram"] == {"use_engram": False}
    with pytest.raises(ConfigError, match="has its own driver"):
        preset.variants("retrofit", "tiny")


def _name_dispatch(path: Path, names: set[str]) -> list[str]:
    """Comparisons of anything with a registered experiment's name (`x == "iso"`, `x in ("edit", ...)`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for c in node.comparators + [node.left]:
            consts = [c] if isinstance(c, ast.Constant) else list(c.elts) if isinstance(c, (ast.Tuple, ast.List,
                                                                                              ast.Set)) else []
            if any(isinstance(k, ast.Constant) and k.value in names for k in consts):
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return out


def test_no_code_branches_on_an_experiment_name():
    """An experiment's behaviour lives in its registration, so no module compares a value with an experiment's
    name (the `if name == "iso"` chains this replaced)."""
    names = {e.name for e in registry.experiments()}
    bad = [x for f in sorted(PACKAGE.glob("*.py")) for x in _name_dispatch(f, names)]
    bad += [x for f in sorted((ROOT / "src" / "engram").rglob("*.py")) for x in _name_dispatch(f, names)
            if "experiment" in x]
    assert not bad, bad


def test_the_dispatch_check_sees_a_name_chain(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('def f(name):\n    if name == "iso":\n        return 1\n    return name in ("edit", "x")\n')
    assert len(_name_dispatch(f, {"iso", "edit"})) == 2


def test_the_commands_scale_choices_are_allocations():
    """`engram experiment --scale` lists its choices without importing the experiments (`engram --help` stays
    light); they are allocation's scales."""
    from engram_experiments import allocation, cli

    assert cli.SCALES == tuple(allocation.SCALES)


def test_run_helpers_shard_argv_and_one_line_errors(capsys):
    import argparse

    from engram_experiments import runs

    ap = argparse.ArgumentParser(prog="x")
    assert runs.parse_shard("1/2", ap) == (1, 2) and runs.parse_shard(" 0/1 ", ap) == (0, 1)
    for bad in ("2/2", "a/b", "1"):
        with pytest.raises(SystemExit):
            runs.parse_shard(bad, ap)
    assert "0 <= K < N" in capsys.readouterr().err
    assert runs.options_argv(argparse.Namespace(out="o", record=None)) == ["--out", "o"]
    assert runs.options_argv(argparse.Namespace(out="o", record="r"))[-2:] == ["--record", "r"]

    def main(argv):
        raise runs.ExperimentError("no runs in X: run Y first")

    with pytest.raises(SystemExit) as e:
        runs.run_cli(main, [])
    assert e.value.code == 2 and capsys.readouterr().err == "engram: no runs in X: run Y first\n"
