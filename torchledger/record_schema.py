"""Deprecated import path: torchledger.record_schema moved to torchledger.record.schema (the package's rooms, docs/architecture.md).
It still works for this release and warns once."""
import warnings as _warnings

from torchledger.record.schema import *  # noqa: F401,F403
from torchledger.record.schema import __all__  # noqa: F401

_warnings.warn("torchledger.record_schema is deprecated: import torchledger.record.schema", DeprecationWarning, stacklevel=2)
