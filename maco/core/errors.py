"""One exception type for errors a user can cause, so the CLI can print them without a traceback."""


class MacoError(ValueError):
    """A bad input (shape, layout, file, missing device) that names the offending value."""
