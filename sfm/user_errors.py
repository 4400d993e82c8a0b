"""How an error the user can fix reaches the user: one line, wherever it happens.

:func:`describe_user_error` is the one rule for what counts as the user's error: an :class:`sfm.errors.SFMError`,
or an S3 client failure the user can act on (an unreachable endpoint, missing or refused credentials:
:func:`sfm.storage.clients.user_error`). Everything else is a bug and keeps its traceback. Three faces use it:

- :func:`exit_status`: the ``sfm`` console script and every process a launcher starts (``python -m MODULE
  JOB.json``) print ``sfm <command>: error: <the line>`` and exit 2;
- :func:`in_flow`: a flow step raises the line as Metaflow's one-line input error (``sfm input error: ...``),
  so the step fails with no traceback.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

from sfm.errors import SFMError

USER_ERROR_EXIT = 2  # what argparse exits with for a bad command line: the user's to fix


def describe_user_error(err: BaseException) -> str | None:
    """The one line that tells the user what to fix, or None when ``err`` is a bug."""
    if isinstance(err, SFMError):
        return str(err)
    from sfm.storage.clients import user_error

    problem = user_error(err)
    return None if problem is None else str(problem)


def exit_status(command: str, run: Callable[[], Any]) -> int:
    """Call ``run()``; a user error is printed as ``sfm <command>: error: ...`` on stderr and returns
    :data:`USER_ERROR_EXIT`; otherwise returns what ``run`` returned (None: 0). Bugs propagate."""
    try:
        status = run()
    except Exception as err:
        line = describe_user_error(err)
        if line is None:
            raise
        print(f"sfm {command}: error: {line}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return int(status or 0)


@functools.cache
def flow_input_error() -> type[Exception]:
    """Metaflow's one-line error type for a step that failed on the user's input (made on first use: only flows
    import Metaflow)."""
    from metaflow.exception import MetaflowException

    class SFMInputError(MetaflowException):
        headline = "sfm input error"

    return SFMInputError


@contextlib.contextmanager
def in_flow() -> Iterator[None]:
    """Inside a flow step: re-raise a user error as :func:`flow_input_error` (one line, no traceback)."""
    try:
        yield
    except Exception as err:
        line = describe_user_error(err)
        if line is None:
            raise
        raise flow_input_error()(line) from None


def deprecated(old: str, new: str) -> None:
    """One line on stderr for an old spelling that still works, for one release: ``old`` as the user wrote it,
    ``new`` what to write instead."""
    print(f"sfm: deprecated: {old} works in this release only; write {new}", file=sys.stderr, flush=True)
