"""Deprecated import path: torchledger.analyzers.calibrate moved to torchledger.steptime.calibrate (the package's rooms, docs/architecture.md).
It still works for this release and warns once."""
import warnings as _warnings

from torchledger.steptime.calibrate import *  # noqa: F401,F403
from torchledger.steptime.calibrate import __all__  # noqa: F401

_warnings.warn("torchledger.analyzers.calibrate is deprecated: import torchledger.steptime.calibrate", DeprecationWarning, stacklevel=2)
