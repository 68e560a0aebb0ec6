"""Third-party noise off unless verbose, for the ``paradiff`` command and the worker processes it starts.

Quiet means: Python warnings of other packages ignored (paradiff's own :class:`ParadiffWarning` always
shows), transformers, diffusers, huggingface_hub and the root logger at ERROR, loading bars off, and in
worker processes PyTorch's C++ warnings off. The progress bars of the image itself stay (rank 0's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ParadiffWarning

#: Read at import by the libraries (and by PyTorch's C++ side at startup): set for worker processes, and
#: here around an in-process run, so that messages printed while the libraries import stay off too.
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
}
#: Loggers set to ERROR (their children inherit it): the libraries' own and the root logger. torchao (which
#: transformers imports when it is installed) warns while it imports, and its import of torch's compiler sets
#: the ``torch`` logger back to WARNING, so the pytree logger it warns through is named on its own.
QUIET_LOGGERS = (
    "",
    "transformers",
    "diffusers",
    "huggingface_hub",
    "torch",
    "torch.utils._pytree",
    "torchao",
    "accelerate",
    "PIL",
)


def quiet_warnings() -> None:
    """Ignore every Python warning except paradiff's own, which show as one line: ``paradiff: warning: ...``."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=ParadiffWarning)  # filters added later take precedence
    warnings.showwarning = _show_warning


_PYTHON_SHOWWARNING = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if not issubclass(category, ParadiffWarning):
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
        return
    stream = file or sys.stderr
    with contextlib.suppress(OSError):  # stderr gone: as Python's own showwarning, say nothing
        print(f"paradiff: warning: {' '.join(str(message).split())}", file=stream, flush=True)


def quiet_libraries() -> None:
    """Loggers to ERROR and the loading bars of diffusers, transformers and huggingface_hub off.

    Imports those libraries' logging modules (diffusers and transformers), so call it where they will be
    imported anyway: in the process that loads the pipeline.
    """
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - transformers is a dependency, but keep quiet mode working
        pass
    else:
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


@contextmanager
def quiet_output(verbose: bool, libraries: bool = True) -> Iterator[None]:
    """Third-party noise off inside the block (nothing changes with ``verbose``); restored afterwards.

    ``libraries=False`` leaves diffusers and transformers unimported (for a process that only launches
    workers, which quiet themselves).
    """
    if verbose:
        yield
        return
    saved_env = {name: os.environ.get(name) for name in QUIET_ENV}
    saved_levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    saved_bars = _library_bars() if libraries else None
    os.environ.update(QUIET_ENV)
    try:
        with warnings.catch_warnings():
            quiet_warnings()
            if libraries:
                quiet_libraries()
            else:
                for name in QUIET_LOGGERS:
                    logging.getLogger(name).setLevel(logging.ERROR)
            yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
        if saved_bars is not None:
            _restore_library_bars(saved_bars)


def _library_bars() -> dict:
    """Whether each library's loading bars are on now, and the libraries' logger levels, to restore later."""
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import are_progress_bars_disabled

    state = {
        "diffusers": diffusers_logging.is_progress_bar_enabled(),
        "diffusers_level": diffusers_logging.get_verbosity(),
        "hub": not are_progress_bars_disabled(),
    }
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover
        return state
    state.update(transformers=transformers_logging.is_progress_bar_enabled())
    state.update(transformers_level=transformers_logging.get_verbosity())
    return state


def _restore_library_bars(state: dict) -> None:
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import enable_progress_bars

    diffusers_logging.set_verbosity(state["diffusers_level"])
    if state["diffusers"]:
        diffusers_logging.enable_progress_bar()
    if state["hub"]:
        enable_progress_bars()
    if "transformers" in state:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(state["transformers_level"])
        if state["transformers"]:
            transformers_logging.enable_progress_bar()
