"""How the CLI says an error: one line on stderr, the exit code of its kind.

Kept apart from ``main`` so that every command module imports on its own (``main``
imports the commands to register them)."""
from __future__ import annotations

import click

from ..errors import EtcError, InputError


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 2."""

    exit_code = 2

    @staticmethod
    def of(exc: EtcError) -> "UserError":
        """The one line for an error of the package's root, with its kind's exit code."""
        message = str(exc) or type(exc).__name__
        return UserError(message) if isinstance(exc, InputError) else RunFailed(message)

    def show(self, file=None) -> None:
        # one line whatever the message quotes (a file's field names may hold newlines)
        message = self.format_message().strip().replace("\r", "\\r").replace("\n", "\\n")
        click.echo(f"slurm-etc: error: {message}", err=True)


class RunFailed(UserError):
    """The run failed although the input was fine (an internal error): one line, exit 3."""

    exit_code = 3
