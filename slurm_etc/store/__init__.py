"""The store (SQLAlchemy 2 + Alembic): the only package that imports sqlalchemy.

Admin policies (``policies``) and the job record (``jobs``) share one schema; a job's live
record is a node-local SQLite file published as snapshots (``location``, ``snapshot``), or
a server database given by URL.
"""
from .db import ENV_DB, Store, StoreError, default_db_path, is_url, open_store, open_store_readonly
from .jobs import (
                 AllocationInfo,
                 DeviceInfo,
                 EventInfo,
                 GenerationInfo,
                 JobDetail,
                 JobSummary,
                 MigrationInfo,
                 RecordError,
                 VrankInfo,
                 close_generation,
                 create_job,
                 job_detail,
                 list_jobs,
                 mark_event_handled,
                 open_generation,
                 open_job_store,
                 pending_events,
                 record_allocation,
                 record_event,
                 record_migration_finish,
                 record_migration_pause,
                 record_migration_start,
                 record_progress,
                 set_coordinator,
                 set_device_state,
                 set_job_state,
                 update_allocation,
)
from .location import (
                 ENV_STATE_DIR,
                 LocationError,
                 default_local_db,
                 default_state_dir,
                 network_fs_refusal,
)
from .policies import StoredPolicy, get_policy, list_policies, set_policy, unset_policy

__all__ = [
    "ENV_DB", "ENV_STATE_DIR", "AllocationInfo", "DeviceInfo", "EventInfo", "GenerationInfo",
    "JobDetail", "JobSummary", "LocationError", "MigrationInfo", "RecordError", "Store",
    "StoreError", "StoredPolicy", "VrankInfo", "close_generation", "create_job",
    "default_db_path", "default_local_db", "default_state_dir", "get_policy", "is_url",
    "job_detail", "list_jobs", "list_policies", "mark_event_handled", "network_fs_refusal",
    "open_generation", "open_job_store", "open_store", "open_store_readonly",
    "pending_events", "record_allocation", "record_event", "record_migration_finish",
    "record_migration_pause", "record_migration_start", "record_progress", "set_coordinator",
    "set_device_state", "set_job_state", "set_policy", "unset_policy", "update_allocation",
]
