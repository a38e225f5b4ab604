"""Deprecated import path: torchledger.spec moved to torchledger.audit.spec (the package's rooms, docs/architecture.md).
It still works for this release and warns once."""
import warnings as _warnings

from torchledger.audit.spec import *  # noqa: F401,F403
from torchledger.audit.spec import __all__  # noqa: F401

_warnings.warn("torchledger.spec is deprecated: import torchledger.audit.spec", DeprecationWarning, stacklevel=2)
