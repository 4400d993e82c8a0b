"""What several ``sfm`` commands share on their command lines: an option's old spelling kept for a release, the
repeatable ``--set``, and the ``--device`` type."""

from __future__ import annotations

import argparse

from sfm.errors import SFMError
from sfm.user_errors import deprecated


class OldSpelling(argparse.Action):
    """An option's old spelling, kept for one release and left out of --help: it stores its value where the new
    option (``new``) does, with a one-line notice (:func:`sfm.user_errors.deprecated`)."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        deprecated(f"{parser.prog} {option_string} {values}", f"{parser.prog} {self.new} {values}")
        setattr(namespace, self.dest, values)


def set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config key set on top of --config and the flags, e.g. --set train.max_steps=500 "
                   "(repeatable; one may also hold several separated by ';')")


def set_values(args: argparse.Namespace) -> list[str]:
    """The ``--set`` values, after the positional SECTION.KEY=VALUE of train and slurm-script (the old spelling,
    kept for one release with a notice)."""
    old = getattr(args, "overrides", None) or []
    if old:
        deprecated(f"sfm {args.command} {' '.join(old)}", f"sfm {args.command} {' '.join('--set ' + o for o in old)}")
    return [*old, *args.set]


def device(text: str) -> str:
    """argparse's type of --device: one of sfm.config_values.DEVICES."""
    from sfm.config_values import check_device

    try:
        return check_device(text)
    except SFMError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
