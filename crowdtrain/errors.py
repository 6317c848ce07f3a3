"""Exceptions that carry the CLI's exit code; their message is one sentence a user can act on."""


class CrowdtrainError(Exception):
    """A failure the CLI reports as one plain sentence; exit code 1."""

    exit_code = 1


class BadInputError(CrowdtrainError, ValueError):
    """Bad usage or bad input: a malformed address, an unreadable config, an unusable path; exit code 2."""

    exit_code = 2


class SwarmUnreachableError(CrowdtrainError):
    """No initial peer answered, or no daemon runs locally to ask; exit code 3."""

    exit_code = 3
