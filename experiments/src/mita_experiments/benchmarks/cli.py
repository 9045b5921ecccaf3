"""``mita demo``, ``mita bench`` and ``mita taxonomy``: the attention zoo on the command line.

``mita bench`` is the one timing command; its first word names what is timed (:data:`DESCRIPTION`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..segmentation import bench as seg
from . import bench, demo, lra, video, vit

#: what ``mita bench`` times: the module of each target (HELP, add_arguments, run)
TARGETS = {"op": bench, "vit": vit, "video": video, "lra": lra, "seg": seg}
DEFAULT_TARGET = "op"
DESCRIPTION = """\
Time MiTA against its baselines. The first word names what is timed (op when left out):

  mita bench [op] --methods mita sdpa --lengths 1024 4096            the attention ops alone
  mita bench vit --models deit_small_patch16_224 --sizes 224:16:25   a timm ViT, converted to MiTA or not
  mita bench video --frames 16 32                                    a Hugging Face VideoMAE, MiTA vs SDPA
  mita bench lra --task listops --lengths 1000 2000                  a Long Range Arena task's model
  mita bench seg --sizes tiny small                                  a Segmenter (ViT + Mask Transformer) at 512 px

Each writes results.csv and results.md to --out (default: a new bench-results/<date-time>);
'mita bench TARGET --help' lists a target's options.
"""


class _BenchParser(argparse.ArgumentParser):
    """``mita bench``'s parser: arguments that do not start with a target are the ``op`` target's,
    and the arguments are recorded (``bench_argv``) for the reports' command lines."""

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(args or ())  # a subcommand's parser is always given its arguments
        if not (args and args[0] in (*TARGETS, "-h", "--help")):
            args = [DEFAULT_TARGET, *args]
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.bench_argv = args
        return parsed, extras


def cmd_demo(args: argparse.Namespace) -> int:
    """``mita demo``: agreement with the reference, then MiTA against SDPA."""
    return demo.run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``mita bench TARGET``: time what the target names (see the module doc)."""
    return TARGETS[args.target].run(args)


def cmd_taxonomy(args: argparse.Namespace) -> int:
    """``mita taxonomy``: the paper's five-dimensional taxonomy of every registered method."""
    from mita.attention import taxonomy_table

    print(taxonomy_table(args.format), end="")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=demo.HELP, description=demo.__doc__)
    demo.add_arguments(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "bench",
        help="time the attention ops (default), a ViT, a VideoMAE or an LRA model",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.__class__ = _BenchParser  # argparse makes every subcommand's parser of one class: this one defaults its target
    targets = p.add_subparsers(dest="target", required=True, metavar="TARGET", parser_class=argparse.ArgumentParser)
    for name, module in TARGETS.items():
        t = targets.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(t)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("taxonomy", help="print the five-dimensional taxonomy of the attention methods")
    p.add_argument("--format", choices=["markdown", "csv"], default="markdown")
    p.set_defaults(func=cmd_taxonomy)
