"""`slurm-etc status` with its output to a pipe (a log, CI): one table row a line, not rich's
80-column layout that wraps every row; the measured pause beside the data phase."""
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from slurm_etc.store import (
    close_generation,
    create_job,
    open_generation,
    open_store,
    record_migration_finish,
    record_migration_pause,
    record_migration_start,
)

from .record_helpers import two_per_node

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 2, 1, 0, 0, tzinfo=timezone.utc)
REASON = ("+99% estimated throughput; dp=4,tp=1,pp=2 is within 3% of the best throughput "
          "and moves the fewest bytes of 2 near-equal configurations")


def _record(path):
    store = open_store(path)
    try:
        create_job(store, "9", name="gpt", owner_uid=os.getuid(), owner_name="me",
                   backend="local", model="tiny", at=T0)
        open_generation(store, "9", 0, "dp=2,tp=1,pp=2", [0, 1, 2, 3], two_per_node(4),
                        first_step=0, at=T0)
        m = record_migration_start(store, "9", from_generation=0, to_generation=1,
                                   plan_digest="d", moved_bytes=3 << 20, kept_bytes=1 << 20,
                                   lower_bound_bytes=3 << 20, messages=2, rounds=1, at=T0)
        close_generation(store, "9", 0, reason=REASON, last_step=5, last_loss=5.0, at=T0)
        open_generation(store, "9", 1, "dp=4,tp=1,pp=2", list(range(8)), two_per_node(8),
                        first_step=5, at=T0)
        record_migration_finish(store, m, outcome="committed", measured_seconds=2.5,
                                pause_seconds=0.75, data_seconds=0.0125, at=T0)
        record_migration_pause(store, m, pause_seconds=0.8125, paused_at=T0,
                               resumed_at=T0 + timedelta(seconds=0.8125),
                               preparation_seconds=4.25, processes=8)
    finally:
        store.close()


def _status(path, columns=None):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "status", "9",
         "--db", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, timeout=120, check=True).stdout


def _rows_whole(out):
    """The migration's row and the generation's, each whole on one line."""
    mig = [ln for ln in out.splitlines() if ln.strip().startswith("0->1")]
    gen = [ln for ln in out.splitlines() if ln.strip().startswith("0 ") and "dp=2" in ln]
    return (len(mig) == 1 and "committed" in mig[0] and "0.81" in mig[0].split()
            and "0.01" in mig[0].split() and "4.25" in mig[0].split()
            and len(gen) == 1 and gen[0].rstrip().endswith("configurations"))


def test_tables_keep_one_row_a_line_in_a_pipe(tmp_path):
    _record(tmp_path / "etc.db")
    out = _status(tmp_path / "etc.db")
    assert _rows_whole(out), out
    # the check itself sees wrapping: forced to 80 columns the rows break
    assert not _rows_whole(_status(tmp_path / "etc.db", columns=80))
