"""The one error a workshop command raises for bad input or a machine that cannot host it."""


class WorkshopError(Exception):
    """Why a workshop command did nothing (or stopped what it had started); the message is one sentence."""
