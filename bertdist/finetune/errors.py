"""The error every task reader raises on input that does not fit its format."""


class DataError(ValueError):
    """Input data that does not fit the task's format; the message names file, line and expectation."""
