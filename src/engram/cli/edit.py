"""`engram edit`: write facts into Engram table rows, as an overlay that `--overlay DIR` applies."""

from __future__ import annotations

import sys
from pathlib import Path

from . import options


def cmd_edit(args) -> int:
    from ..editing import chat_contexts, edit_facts, edit_report, paraphrase_contexts, print_report, read_facts
    from ..training.data import text_windows

    if args.out and Path(args.out).is_file():
        raise ValueError(f"--out {args.out} is a file; give a folder for the overlay")
    model, tok = options.load_for_inference(args)
    facts = read_facts(args.facts, tok)  # every fact checked before anything runs or is written
    optimized = facts + (_chat_facts(args, facts, chat_contexts) if args.chat else []) + \
        (paraphrase_contexts(facts) if args.paraphrases else [])
    keep = read_facts(args.keep, tok) if args.keep else None
    if args.keep_weight is not None and not args.keep:
        raise ValueError("--keep-weight weighs the --keep facts; give --keep FILE too (or drop --keep-weight)")
    options.with_overlays(model, args.overlay)
    windows = text_windows(tok, args.data, args.split, args.seq_len, args.max_windows)
    print(f"editing {len(facts)} facts: rows at {args.positions} positions, orders "
          f"{args.orders or 'highest'}, up to {args.steps} steps" +
          (f", {len(keep)} facts kept as they are" if keep else ""), file=sys.stderr)
    overlay = edit_facts(model, tok, optimized, steps=args.steps, lr=args.lr, positions=args.positions,
                         orders=args.orders, target_prob=args.target_prob, chunk=args.chunk, patience=args.patience,
                         keep=keep, keep_weight=1.0 if args.keep_weight is None else args.keep_weight)
    overlay.meta["base"] = str(args.checkpoint or f"{args.base} + {args.adapter}")
    report = edit_report(model, tok, facts, overlay, windows, args.batch_size, chunk=args.chunk, progress=True)
    overlay.meta["summary"] = report["summary"]
    out = overlay.save(args.out, {"report.json": report})  # written as JSON piece by piece
    print_report(report)
    print(f"wrote overlay {out} ({overlay.num_rows:,} rows) and {out / 'report.json'}; apply it with --overlay {out}")
    return 0


def _chat_facts(args, facts, chat_contexts) -> list:
    """--chat: each fact with a "question" again inside the model's own chat template (`chat_contexts`)."""
    from ..inference import chat_renderer, model_chat_template

    template = model_chat_template(args.checkpoint, args.base)
    if not template:
        raise ValueError(f"--chat: {args.base or args.checkpoint} has no chat template (chat_template.jinja or "
                         "tokenizer_config.json); edit without --chat")
    if not any(f.question for f in facts):
        raise ValueError(f'--chat: no fact in {args.facts} has a "question" (the user turn its answer starts with)')

    def refuse(message):
        raise ValueError(f"--chat: the chat template refused a question: {message}")

    return chat_contexts(facts, chat_renderer(template, refuse))


def add_commands(sub) -> None:
    source = options.model_source(
        base_help="a pretrained transformers model folder (with --adapter: its Engram adapter)",
        adapter_help="Engram adapter folder (or an `engram adapt` run dir)")
    windows = options.eval_windows(max_windows=64,
                                   data_help="text for the collision set and locality (default Shakespeare)")
    ed = sub.add_parser("edit", help="write facts into Engram table rows: an overlay for --overlay (engram edit)",
                        parents=[source, windows, options.overlays(), options.table_tier()],
                        epilog="--checkpoint also takes a qwen4_exp model folder (Qwen3.8-Flash-Next): its n-gram "
                        "table rows are edited, and engram serve --checkpoint PATH --overlay NAME=DIR serves them per "
                        "request")
    ed.add_argument("--facts", required=True, help='JSONL, one {"prompt": ..., "target": ...} per line '
                    '(optional "paraphrases": [...], "passages": [...], "question": "...", "subject": "...")')
    ed.add_argument("--out", required=True, help="overlay folder to write (with report.json)")
    ed.add_argument("--steps", type=int, default=300, help="most optimization steps (stops once every fact is met)")
    ed.add_argument("--lr", type=float, default=0.1, help="Adam learning rate on the edited rows")
    ed.add_argument("--positions", default="trigger", choices=options.POSITIONS,
                    help="trigger: rows read where the target is predicted; all: every prompt position too; subject: "
                         "the rows the fact's \"subject\" tokens read (every order); subject+trigger: both")
    ed.add_argument("--orders", action=options.ListFlag, item=int, spaced=True,
                    help="n-gram orders whose rows change, a comma list, e.g. 2,3 (default: the highest; every order "
                         "with --positions subject)")
    ed.add_argument("--chunk", type=int, default=64,
                    help="sequences per forward: each step sums the gradients of every chunk, and the report scores "
                         "the facts chunk by chunk, so memory is bounded by one chunk whatever the number of facts "
                         "(lower it if memory is short)")
    ed.add_argument("--patience", type=int, metavar="N",
                    help="also stop once N steps in a row meet no more facts than before and lower the loss by "
                         "under 1%% (facts that conflict can never all be met; default: run up to --steps)")
    ed.add_argument("--keep", metavar="FILE",
                    help="JSONL facts (the --facts format) the edit should leave answering as they do: their rows are "
                         "not written, their targets join the loss, so rows shared with the edited facts are pulled "
                         "back (locality held as data; e.g. other subjects of an edited relation -> their answers)")
    ed.add_argument("--keep-weight", type=float, metavar="W",
                    help="weight of the --keep facts' mean loss against the edited facts' (default 1)")
    ed.add_argument("--target-prob", type=float, default=0.9, help="stop when every target token has this probability")
    ed.add_argument("--chat", action="store_true",
                    help='also optimize each fact with a "question" inside the model\'s chat template (the user turn, '
                         "then the prompt as the answer's start), so the edit holds in chat answers")
    ed.add_argument("--paraphrases", action="store_true",
                    help="also optimize each fact in its paraphrases (those naming its subject as the prompt does), "
                         "so rows written at the subject serve them too (`editing.paraphrase_contexts`)")
    ed.set_defaults(func=cmd_edit)
