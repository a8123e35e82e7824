"""The one exception type for bad input, shared by every area (telemetry is the root of the import graph)."""


class InputError(ValueError):
    """Input that does not fit what it is given to (a file, a trace, a recipe key, a size).

    Raised where the input enters, with the value and what was expected. The CLI prints its message as one
    line and exits with status 2; any other exception is a bug and keeps its traceback.
    """
