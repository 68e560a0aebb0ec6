"""Exceptions paradiff raises for bad input; each message names what would work."""


class ParadiffError(ValueError):
    """A configuration, input or model that paradiff cannot run, found before any collective."""
