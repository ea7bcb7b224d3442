"""The runtime's exceptions and how an error becomes the one line a user reads."""

from contextlib import contextmanager

# EX_TEMPFAIL from sysexits.h, "temporary failure, the user is invited to retry": a run stopped by
# SIGTERM or SIGUSR1 after saving a checkpoint exits with it, so a job script can tell "requeue me"
# from a failure.
PREEMPTED_EXIT_CODE = 75


class RecipeError(Exception):
    """A problem the user can fix. Printed as one line (cause and fix), without a traceback."""


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint; the message says where and how to
    continue."""


def first_line(err: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message: the cause, in one
    line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextmanager
def explain_load_failure(name: str, also: str = ""):
    """Around loading `--model NAME` (a model or its tokenizer): transformers' OSError or ValueError
    (no such folder or repository, no network, missing files) becomes one line that says what to
    give instead; `also` adds what else this recipe accepts, e.g. ", a .gguf file"."""
    try:
        yield
    except (OSError, ValueError) as err:
        raise RecipeError(
            f"could not load --model {name!r} ({first_line(err)}); give a local folder with config.json, the "
            f"weights and the tokenizer files{also}, or a Hugging Face Hub name while online (cached under "
            "~/.cache/huggingface)"
        ) from None
