"""The one error type of the submission path; its message is shown to the user as is."""


class SubmitError(RuntimeError):
    """A job that cannot be rendered or submitted, with a message that says why and what to do."""
