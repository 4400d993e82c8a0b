"""How a flow step reports an error the user can fix: one line, no traceback (every flow's steps use it)."""

from __future__ import annotations

import contextlib

from metaflow.exception import MetaflowException


class SFMInputError(MetaflowException):
    headline = "sfm input error"


@contextlib.contextmanager
def user_errors():
    """Report errors the user can fix as one line (no traceback); bugs keep theirs."""
    from sfm.errors import SFMError
    from sfm.storage.clients import user_error

    try:
        yield
    except SFMError as err:
        raise SFMInputError(str(err)) from None
    except Exception as err:
        problem = user_error(err)  # S3 unreachable or credentials missing: the user's to fix
        if problem is None:
            raise
        raise SFMInputError(str(problem)) from None
