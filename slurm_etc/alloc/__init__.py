"""Virtual rank allocator and configuration chooser: pure, no I/O."""
from .chooser import Candidate, Choice, Hardware, TrainingJob, choose_config, tokens_per_second
from .errors import AllocationError
from .migration import MigrationCost, migration_cost, placement_moved_bytes
from .topology import ClusterTopology, Device
from .vranks import (
    Allocation,
    allocate,
    capacity,
    identity_layout,
    number_vranks,
    select_devices,
    split_tp_groups,
)

__all__ = ["Allocation", "AllocationError", "Candidate", "Choice", "ClusterTopology", "Device",
    "Hardware", "MigrationCost", "TrainingJob", "allocate", "capacity", "choose_config",
    "identity_layout", "migration_cost", "number_vranks", "placement_moved_bytes",
    "select_devices", "split_tp_groups", "tokens_per_second"]
