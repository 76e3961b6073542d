"""The single error path of the CLI: an expected failure becomes ONE line and exit status 2.

    spectrain eval: error: <what went wrong, which file or option, how to fix it>
      (SPECTRAIN_DEBUG=1 shows the traceback)

Expected failures are the exception types bad input raises (ValueError, OSError and its subclasses,
KeyError, safetensors' and pickle's read errors ...). Anything else is a bug: it is also reported as one
line (exit status 1) that asks for a report with the traceback. ``SPECTRAIN_DEBUG=1`` re-raises so the
traceback prints. A full disk is recognised whichever library hit it (``ENOSPC``, torch's
"unexpected pos", safetensors' write errors) and said in plain words, naming the path; ``writing(path)``
marks a command's own partial output so it is removed when the write fails.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEBUG_ENV = "SPECTRAIN_DEBUG"
DEBUG_HINT = f"({DEBUG_ENV}=1 shows the traceback)"
# Messages of libraries that hit a full disk without an ENOSPC errno on the exception.
_DISK_FULL_TEXT = ("no space left on device", "unexpected pos", "file write failed", "disk quota exceeded",
                   "storagefull")


# Libraries' exceptions that report a user's setup, not a bug (safetensors, huggingface_hub, wandb, click).
_THIRD_PARTY_USER_ERRORS = {"SafetensorError", "HeaderTooLarge", "HFValidationError", "UsageError", "CommError",
                            "AuthenticationError"}


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_disk_full(e: BaseException) -> bool:
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x).lower()
        if any(t in text for t in _DISK_FULL_TEXT) and type(x).__name__ in ("RuntimeError", "SafetensorError",
                                                                           "OSError", "IOError"):
            return True
    return False


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def writing(path, name=None, remove: bool = True) -> Iterator[Path]:
    """Mark ``path`` as this command's partial output: if the body fails, ``path`` is removed (nothing
    half-written stays behind; ``remove=False`` only names it) and the error is tagged with ``name`` (the
    output the user asked for; default ``path``) for the disk-full message."""
    path = Path(path)
    try:
        yield path
    except BaseException as e:
        if remove:
            _remove(path)
        if not hasattr(e, "spectrain_path"):
            try:
                e.spectrain_path = str(name or path)
            except AttributeError:  # some C-level exception types refuse new attributes
                pass
        raise


def disk_full_message(e: BaseException) -> str:
    path = getattr(e, "spectrain_path", None) or next(
        (x.filename for x in _chain(e) if isinstance(x, OSError) and x.filename), None)
    where = f" while writing {path}" if path else ""
    return (f"disk full{where} (no space left on the device); the partial output was removed: free space on that "
            "filesystem (or point the output elsewhere) and rerun")


def _expected(e: BaseException) -> bool:
    import pickle

    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, (ValueError, OSError, KeyError, pickle.UnpicklingError, EOFError)) or \
        bool(names & _THIRD_PARTY_USER_ERRORS)


def message(e: BaseException) -> str:
    """The one-line text for ``e`` (without the command prefix)."""
    if is_disk_full(e):
        return disk_full_message(e)
    if isinstance(e, KeyError):
        return f"missing key {e.args[0]!r}" if e.args else "missing key"
    text = " ".join(str(e).split()) or type(e).__name__
    if type(e).__name__ in ("UsageError", "CommError", "AuthenticationError"):
        text = f"{type(e).__module__.split('.')[0]}: {text}"  # say which library (e.g. wandb) is unhappy
    if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, FileExistsError)) and e.filename \
            and str(e.filename) not in text:
        text += f" ({e.filename})"
    return text


def report(command: str, e: BaseException) -> int:
    """Print ``e`` as one line on stderr and return the exit status (2 expected, 1 a bug, 130 Ctrl-C).
    With SPECTRAIN_DEBUG=1 the exception is re-raised instead, so Python prints the traceback."""
    if isinstance(e, SystemExit):
        raise e
    if debug():
        raise e
    if isinstance(e, KeyboardInterrupt):
        print(f"spectrain {command}: interrupted", file=sys.stderr)
        return 130
    if _expected(e) or is_disk_full(e):
        print(f"spectrain {command}: error: {message(e)} {DEBUG_HINT}", file=sys.stderr)
        return 2
    print(f"spectrain {command}: internal error: {type(e).__name__}: {' '.join(str(e).split())} -- please report "
          f"it with the traceback ({DEBUG_ENV}=1 shows it)", file=sys.stderr)
    return 1
