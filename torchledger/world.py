"""Deprecated import path: torchledger.world moved to torchledger.audit.world (the package's rooms, docs/architecture.md).
It still works for this release and warns once."""
import warnings as _warnings

from torchledger.audit.world import *  # noqa: F401,F403
from torchledger.audit.world import __all__  # noqa: F401

_warnings.warn("torchledger.world is deprecated: import torchledger.audit.world", DeprecationWarning, stacklevel=2)
