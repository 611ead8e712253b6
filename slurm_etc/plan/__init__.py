"""Pure migration planning: no torch.distributed, no I/O."""
from .catalog import Catalog, TensorGroup, build_catalog
from .config import Layout, ParallelConfig
from .errors import ConfigError, PlanError, StateLostError
from .model import PRESETS, ModelDesc, load_model
from .plan import MigrationPlan, default_pool, plan_migration
from .schedule import Topology

__all__ = ["Catalog", "ConfigError", "Layout", "MigrationPlan", "ModelDesc", "PRESETS",
           "ParallelConfig", "PlanError", "StateLostError", "TensorGroup", "Topology",
           "build_catalog", "default_pool", "load_model", "plan_migration"]
