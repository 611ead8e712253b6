"""One error root for slurm-etc, with the two kinds the command line tells apart.

Every error the package raises on purpose derives from :class:`EtcError` through one of its
kinds; the CLI maps the kind to one line on stderr and an exit code, nothing else:

- :class:`InputError` (exit 2): what was asked, or a file it names, cannot work — a layout,
  a model description, a policy value, a trace, a database that is not ours. Fixed by
  changing the input; the message says what was wrong and what would be right.
- :class:`InternalError` (exit 3): the run failed although the input was fine — a worker
  died, Slurm or the network refused, a plan broke its own invariants (a bug). The message
  says what failed; the traceback is logged at debug level (``slurm-etc -vv``).

Kinds keep a builtin base beside the root where callers catch the builtin
(``class ConfigError(InputError, ValueError)``), so the root adds a classification
without changing what existing handlers see. Pure: imports nothing.
"""
from __future__ import annotations


class EtcError(Exception):
    """The root of every error slurm-etc raises on purpose."""

    exit_code = 1


class InputError(EtcError):
    """The input cannot work: one line naming what was wrong and what would be right."""

    exit_code = 2


class InternalError(EtcError):
    """The run failed with valid input (a process, Slurm, the network, or a bug)."""

    exit_code = 3
