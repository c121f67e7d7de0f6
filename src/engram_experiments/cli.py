"""`engram experiment` and `engram results`: the evidence experiments and the pages rendered from their records.

The library's `engram` command finds these through the `engram.cli` entry-point group (`engram.cli.plugins`); the
library itself imports nothing of this package.
"""

from __future__ import annotations

from engram.cli import options

SCALES = ("cpu", "gpu", "tiny")  # allocation's `--scale` (allocation.SCALES; a test keeps the two equal)



def cmd_experiment(args) -> int:
    from . import registry, replication
    from .preset import run_experiment

    if args.list or not args.name:
        print(registry.listing())
        print(f"  {'NAME' + replication.SUFFIX:<12} {replication.LISTING}")
        return 0
    if args.name.endswith(replication.SUFFIX):  # a claim run again on new seeds: its design is its preregistration
        replication.run(args.name, args.out, record=args.record, jobs=args.jobs, max_steps=args.max_steps)
        return 0
    for n in [e.name for e in registry.experiments() if e.run and e.in_all] if args.name == "all" else [args.name]:
        run_experiment(n, out=args.out, seeds=args.seeds, preset=args.preset, data=args.data,
                       max_steps=args.max_steps, size=args.size, checkpoint=args.checkpoint, scale=args.scale,
                       record=args.record, plan_only=args.plan_only, finished_only=args.finished_only, jobs=args.jobs,
                       variants_only=args.variants.split(",") if args.variants else None)
    return 0


def cmd_results(args) -> int:
    from . import report

    return report.main(args.dir, args.template, args.out, args.img, check=args.check)


def add_commands(sub) -> None:
    ex = sub.add_parser("experiment", help="evidence experiments (iso, placement, capacity, ablations, sensitivity, "
                                           "retrofit, edit, allocation, adapter-init, smollm2-adapt, smollm2-edit, "
                                           "all; ablations-replication, sensitivity-replication, "
                                           "allocation-replication, retrofit-replication, edit-replication)")
    ex.add_argument("name", nargs="?")
    ex.add_argument("--list", action="store_true")
    ex.add_argument("--seeds", type=int, default=3)
    ex.add_argument("--out", default="runs/experiments")
    ex.add_argument("--record", metavar="DIR", help="also write the per-seed results to DIR/NAME.json "
                                                    "(docs/results in this repository; `engram results` renders them)")
    ex.add_argument("--preset", default="exp", metavar=options.preset_metavar(),
                    help="model/training preset of every run")
    ex.add_argument("--data", action="append")
    ex.add_argument("--max-steps", type=int)
    ex.add_argument("--size", default="default", choices=["default", "small"], help="small: fewer capacity points")
    ex.add_argument("--checkpoint", help="edit: a trained cpu-small run to edit (default: train one in OUT/edit/base)")
    ex.add_argument("--scale", default="cpu", choices=SCALES,
                    help="allocation: cpu (hidden 128, ~100 min on 2 cores), gpu (hidden 512, 12 layers), tiny (tests)")
    ex.add_argument("--finished-only", action="store_true",
                    help="train nothing: summarize (and --record) the runs that have finished")
    ex.add_argument("--variants", metavar="A,B",
                    help="allocation: train only these variants (e.g. moe-E16,moe-E14+engram); the others are "
                         "reported where their runs finished")
    ex.add_argument("--jobs", type=int, default=1,
                    help="retrofit, smollm2-adapt and the preset experiments (iso, design, ...): runs trained at "
                         "once, each in its own process with cores/JOBS threads unless OMP_NUM_THREADS is set "
                         "(default 1)")
    ex.add_argument("--plan-only", action="store_true",
                    help="allocation: write and print the accounting (parameters, widths, primes, FLOPs); "
                         "train nothing")
    ex.set_defaults(func=cmd_experiment)

    rs = sub.add_parser("results",
                        help="regenerate docs/results.md, docs/performance.md and the plots from the committed "
                             "records in docs/results/ (every number rendered from a record or marked quoted)")
    rs.add_argument("--dir", default="docs/results", help="per-seed JSON files (default docs/results)")
    rs.add_argument("--template", help="one page's template (default: docs/results.in.md and "
                                       "docs/performance.in.md)")
    rs.add_argument("--out", help="the page --template renders to (default: its name without .in)")
    rs.add_argument("--img", default="docs/img", help="where the plots go ('' for none)")
    rs.add_argument("--check", action="store_true",
                    help="write nothing: exit 1 if a page is not what its template and the records give, or its "
                         "template holds a number or verdict not rendered from a record")
    rs.set_defaults(func=cmd_results)
