"""The `sfm` console script.

Every subcommand turns a user-caused problem (an :class:`sfm.errors.SFMError`, an unreachable bucket: the rule of
:func:`sfm.user_errors.describe_user_error`) into one line on stderr and exit status 2; bugs keep their tracebacks.
"""

from __future__ import annotations

import argparse

from sfm.cli import data_commands, model_commands, policy_commands, run_commands
from sfm.user_errors import exit_status


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusal of a command line (an unknown flag, a value not among the choices, a missing
    option) is one line, as every other error of sfm is; ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``sfm --version``: the package's version, and the code version (the git commit) in a checkout."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import sfm
        from sfm.model.registry import code_version

        code = code_version()
        print(f"sfm {sfm.__version__}" + (f" (code version {code}: a git checkout)" if code != sfm.__version__ else ""))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sfm", description="Seismic foundation model pipeline")
    parser.add_argument("--allow-insecure-s3", action="store_true",
                        help="allow a plain-http S3 endpoint off loopback (same as SFM_ALLOW_INSECURE_S3=1)")
    parser.add_argument("--version", action=_Version, help="print the package's version (and the code version, the "
                        "git commit, in a checkout) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    data_commands.add_commands(sub)
    model_commands.add_commands(sub)
    run_commands.add_commands(sub)
    policy_commands.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.allow_insecure_s3:
        import os

        from sfm.storage.security import INSECURE_ENV

        os.environ[INSECURE_ENV] = "1"
    return exit_status(args.command, lambda: args.func(args))
