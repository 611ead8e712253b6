"""`slurm-etc` command group: a thin shell over the library (one module per command)."""
from __future__ import annotations

import logging
import sys

import click

from ..bounds import BoundError
from ..coordinator.channel import SecretError
from ..plan.errors import ConfigError
from ..store.db import StoreError
from ..store.location import LocationError

# Mistakes in what was asked or in the files named (a model, a trace, a corrupt, locked or
# foreign database, an unknown job): one line, never a traceback.
_DOMAIN_ERRORS = (ConfigError, StoreError, LocationError, SecretError, BoundError)


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        # one line whatever the message quotes (a file's field names may hold newlines)
        message = self.format_message().strip().replace("\r", "\\r").replace("\n", "\\n")
        click.echo(f"slurm-etc: error: {message}", err=True)


class EtcGroup(click.Group):
    """Turns domain errors into one clear line instead of a traceback, and click's own usage
    errors (bad option values, missing options) into one line too (exit 2)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except _DOMAIN_ERRORS as exc:
            raise UserError(str(exc) or type(exc).__name__) from None

    def main(self, args=None, prog_name=None,
             complete_var=None, standalone_mode: bool = True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            message = " ".join(exc.format_message().split())
            click.echo(f"slurm-etc: error: {message}{where}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            if isinstance(exc, UserError):
                exc.show()
            else:  # click's own "Error: ..." in the same one-line form
                UserError(exc.format_message()).show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        # click returns an Exit's code without exiting when not standalone
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=EtcGroup, context_settings={"auto_envvar_prefix": "SLURM_ETC",
                                             "help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output on stderr.")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """slurm-etc: elastic training on Slurm with in-place, checkpoint-free resizes."""
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    ctx.ensure_object(dict)


def _register() -> None:
    from . import (
        cmd_bench,
        cmd_demo,
        cmd_plan,
        cmd_policy,
        cmd_run,
        cmd_simulate,
        cmd_status,
        cmd_verify,
    )

    cli.add_command(cmd_plan.plan)
    cli.add_command(cmd_policy.policy)
    cli.add_command(cmd_simulate.simulate_cmd)
    cli.add_command(cmd_status.status)
    cli.add_command(cmd_verify.verify)
    cli.add_command(cmd_bench.bench)
    cli.add_command(cmd_run.run)
    cli.add_command(cmd_demo.demo)


_register()


def main() -> None:
    cli(prog_name="slurm-etc")
