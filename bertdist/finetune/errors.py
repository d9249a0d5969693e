"""The error every task reader raises on input that does not fit its format."""


class DataError(ValueError):
    """Input data that does not fit the task's format; the message names file, line and expectation."""


def not_utf8(path, e: UnicodeDecodeError) -> DataError:
    """The error for a task file that is not UTF-8 text (a binary file, another encoding)."""
    return DataError(f"{path}: not UTF-8 text (byte {e.start} of the undecodable part): task files are UTF-8; "
                     "convert it (e.g. iconv -f latin1 -t utf-8)")
