"""The library's own exception types."""


class InputError(ValueError):
    """A kernel argument is malformed; the message names the argument and what was expected."""
