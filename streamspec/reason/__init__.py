"""SpecReason with speculative streaming: a drafter writes reasoning steps, a base judges them.

The pieces: `ReasonConfig` / `BackendConfig` (settings), `LocalBackend` / `ServerBackend` (where a
model runs), `SpecReasoner` (the algorithm and its baselines), `ReasonTrace` (what a run
records); `streamspec.reason.evaluate`, `.report`, `.grading` and `.tasks` for evaluation.
"""

from .backends import BackendError, LocalBackend, ServerBackend, backend_from_config
from .config import BackendConfig, ReasonConfig, load_reason_config
from .reasoner import METHODS, SpecReasoner
from .trace import ReasonTrace, Step

__all__ = [
    "METHODS",
    "BackendConfig",
    "BackendError",
    "LocalBackend",
    "ReasonConfig",
    "ReasonTrace",
    "ServerBackend",
    "SpecReasoner",
    "Step",
    "backend_from_config",
    "load_reason_config",
]
