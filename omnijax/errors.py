"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad config, missing file, bad record: something the user fixes, not a bug."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value; the message names the field and what is allowed."""


class BadSample(UserError):
    """A sample whose segments cannot be encoded (empty image, zero-length audio, zero-frame video...)."""
