"""Errors a user can act on: each says what is wrong and what to do about it."""


class MoetierError(Exception):
    """Base class. The CLI prints the message and exits non-zero without a traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class ModelNotFoundError(MoetierError):
    pass


class UnsupportedModelError(MoetierError):
    pass


class CheckpointError(MoetierError):
    pass


class StoreError(MoetierError):
    pass


class ChecksumError(StoreError):
    pass


class BudgetError(MoetierError):
    pass


class PromptTooLongError(MoetierError):
    pass
