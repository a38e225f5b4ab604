"""Deprecated import path: torchledger.record_json moved to torchledger.record.jsonio (the package's rooms, docs/architecture.md).
It still works for this release and warns once."""
import warnings as _warnings

from torchledger.record.jsonio import *  # noqa: F401,F403
from torchledger.record.jsonio import __all__  # noqa: F401

_warnings.warn("torchledger.record_json is deprecated: import torchledger.record.jsonio", DeprecationWarning, stacklevel=2)
