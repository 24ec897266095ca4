"""The one error of the data stage, raised wherever a text source is read."""


class DataError(ValueError):
    """The text source cannot be read; the message says what to pass instead."""
