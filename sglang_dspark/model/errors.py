"""Errors raised by the model layer."""


class CheckpointError(ValueError):
    """A drafter config or checkpoint is missing something, or holds something inconsistent.

    The message always names the offending key (or weight) and what was expected, so that an operator
    can fix the checkpoint without reading this code.
    """
