"""The errors the front end raises to its callers."""


class InvalidRequestError(ValueError):
    """Bad input from the caller; names the parameter at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """More requests are in flight than the front end may hold; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; every pending and future request fails with this."""
