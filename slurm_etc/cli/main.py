"""`slurm-etc` command group: a thin shell over the library (one module per command)."""
from __future__ import annotations

import logging
import sys

import click

from ..plan.errors import ConfigError


class UserError(click.ClickException):
    """A mistake in what the user asked for: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"slurm-etc: error: {self.format_message()}", err=True)


class EtcGroup(click.Group):
    """Turns domain errors (ConfigError) into one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            raise UserError(str(exc)) from None


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
