"""``python -m sfm.distributed.rank_launcher torchrun|accelerate ARGS...``: one node's ranks started by torchrun or
``accelerate launch`` with ARGS (as :func:`sfm.distributed.launch.node_command` builds them).

The launcher runs in this process. When a rank fails, what the rank printed stands above (a user error: one line,
:func:`sfm.user_errors.exit_status`), and the launcher's own report, a Python traceback of torchrun's or Accelerate's
internals that says nothing about the failure, is replaced by one line naming the rank and its exit status. The
process exits with that status.
"""

from __future__ import annotations

import subprocess
import sys

LAUNCHERS = ("torchrun", "accelerate")


def start(launcher: str, args: list[str]) -> None:
    """Run ``launcher`` with its command-line ``args`` here; raises what it raises when a rank fails."""
    if launcher == "torchrun":
        from torch.distributed.run import get_args_parser, run

        run(get_args_parser().parse_args(args))
    else:
        from accelerate.commands.launch import launch_command, launch_command_parser

        launch_command(launch_command_parser().parse_args(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in LAUNCHERS:
        print(f"usage: python -m sfm.distributed.rank_launcher {{{','.join(LAUNCHERS)}}} ARGS...", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launcher = argv[0]
    try:
        start(launcher, argv[1:])
    except ChildFailedError as err:  # torchrun, or accelerate launch of several processes
        rank, failure = err.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 1  # a signal: negative
        how = f"exit {failure.exitcode}" if failure.exitcode >= 0 else f"signal {-failure.exitcode}"
        print(f"sfm: rank {rank} failed ({how}); {launcher} stopped the others", file=sys.stderr, flush=True)
        return status
    except subprocess.CalledProcessError as err:  # accelerate launch of one process
        print(f"sfm: rank 0 failed (exit {err.returncode})", file=sys.stderr, flush=True)
        return err.returncode if err.returncode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
