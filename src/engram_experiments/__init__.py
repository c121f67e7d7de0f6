"""engram's evidence experiments, apart from the library: each one a registered `Experiment` (`registry.py`).

This package sits beside `engram` in the same distribution (`pip install engram-torch` installs both) so that
`engram experiment` and `engram results` work from one install, while the library imports nothing of it (the
architecture test checks). It uses only the library's public names. Layout:

    registry.py      the `Experiment` interface and the registry (`get`, `names`, `find`)
    preset.py        experiments on variants of one training preset: iso, placement, capacity, ablations,
                     sensitivity, design
    retrofit.py, allocation.py, edit.py (+ world.py, its synthetic facts), adapter_init.py, smollm2_adapt.py,
    smollm2_edit.py (+ known_facts.py, real capitals): experiments with their own drivers
    replication.py   NAME-replication: a recorded claim run again on new seeds, read from its preregistration
    runs.py          training runs for experiments (reused, resumed, in worker processes), seed statistics
    records.py       the committed records (docs/results/*.json): how they are written, tabled and plotted
    report.py        `engram results`: the pages rendered from the records, and the number guard
    significance.py, prereg.py   the tests fixed in advance, and the preregistrations that fix them
    cli.py           the `experiment` and `results` commands (the `engram.cli` entry point)

Importing the package imports none of them (so `engram --help` stays fast): `catalog.py` imports every
experiment module, in the order `engram experiment all` runs them, and the registry loads it (through the
`engram.experiments` entry-point group, where other packages can add theirs) the first time it is asked.
"""
