"""The `sfm` console script.

Every subcommand turns a user-caused problem (:class:`sfm.errors.SFMError`) into one line on stderr
and exit status 2; bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys

from sfm.errors import SFMError


def _cmd_synth(args: argparse.Namespace) -> None:
    from sfm.synth import synth_survey

    result = synth_survey(
        args.out,
        shape=tuple(args.shape),
        seed=args.seed,
        sample_format=args.format,
        endian=args.endian,
        iline_byte=args.iline_byte,
        xline_byte=args.xline_byte,
        sorting=args.sorting,
    )
    print(json.dumps(result))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfm", description="Seismic foundation model pipeline")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic post-stack SEG-Y survey and its fault labels")
    p.add_argument("out", help="output SEG-Y path (fault labels are written beside it)")
    p.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "NS"), default=[64, 64, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", type=int, choices=[1, 3, 5, 8], default=5, help="SEG-Y sample format code")
    p.add_argument("--endian", choices=["big", "little"], default="big")
    p.add_argument("--iline-byte", type=int, default=189)
    p.add_argument("--xline-byte", type=int, default=193)
    p.add_argument("--sorting", choices=["inline", "crossline"], default="inline")
    p.set_defaults(func=_cmd_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SFMError as err:
        print(f"sfm {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
