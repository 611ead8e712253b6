"""`slurm-etc` command group: a thin shell over the library (one module per command)."""
from __future__ import annotations

import logging
import sys

import click

from ..errors import EtcError, InputError
from .errors import UserError

__all__ = ["UserError", "cli", "main"]

logger = logging.getLogger(__name__)


class EtcGroup(click.Group):
    """Turns domain errors into one clear line instead of a traceback, and click's own usage
    errors (bad option values, missing options) into one line too (exit 2)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except EtcError as exc:
            # the root's kinds: input (exit 2) and internal (exit 3), one line either way;
            # an internal one's traceback for whoever runs with -vv
            if not isinstance(exc, InputError):
                logger.debug("internal error", exc_info=exc)
            raise UserError.of(exc) from None

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
        cmd_policy_enforce,
        cmd_run,
        cmd_simulate,
        cmd_soak,
        cmd_status,
        cmd_verify,
    )

    cli.add_command(cmd_plan.plan)
    cmd_policy.policy.add_command(cmd_policy_enforce.apply)
    cmd_policy.policy.add_command(cmd_policy_enforce.check)
    cli.add_command(cmd_policy.policy)
    cli.add_command(cmd_simulate.simulate_cmd)
    cli.add_command(cmd_status.status)
    cli.add_command(cmd_verify.verify)
    cli.add_command(cmd_bench.bench)
    cli.add_command(cmd_run.run)
    cli.add_command(cmd_demo.demo)
    cli.add_command(cmd_soak.soak)


_register()


def main() -> None:
    cli(prog_name="slurm-etc")
