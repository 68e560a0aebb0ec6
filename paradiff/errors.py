"""Exceptions paradiff raises; each message names what went wrong and what would work."""


class ParadiffError(ValueError):
    """A configuration, input or model that paradiff cannot run, found before any work; ranks that disagree on
    what they run; or (:class:`PeerFailure`) a rank lost mid-run."""


class ParadiffWarning(UserWarning):
    """Something paradiff runs but the user should know (a prompt word the built-in model does not know, say).

    The CLI silences third-party warnings by default; warnings of this category always show.
    """


class PeerFailure(ParadiffError, RuntimeError):
    """Another rank died, froze or left mid-run: raised on the ranks that remain, naming it and what was waited for.

    A ``RuntimeError`` too, as the transport errors it replaces were.
    """
