"""Exceptions raised by the scheduler."""


class SchedulerError(Exception):
    """Base class."""


class ContextNotFound(SchedulerError):
    """No manifest with that context id in the store."""


class ManifestError(SchedulerError):
    """A manifest read from the store is not valid."""


class PrefixIndexError(SchedulerError):
    """A prefix index read from the store is not valid."""
