"""``given``, ``settings`` and ``st`` from hypothesis where it is installed, else stand-ins
under the same names that collect each property test as skipped, so the rest of its module
still runs. hypothesis comes with the ``test`` extra; a machine that runs the project from
source without it (the GPU machine's python3: pytest, no registry) would otherwise stop at
collection with an ImportError, before any test ran, the CUDA ones included.
"""
import pytest

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    def _strategy(*args, **kwargs):         # st.integers(1, 9), st.composite(fn), fn(): all inert
        return _strategy

    class _Strategies:
        def __getattr__(self, name):
            return _strategy

    st = _Strategies()

    def settings(*args, **kwargs):
        return lambda fn: fn

    def given(*args, **kwargs):
        def skipped(fn):
            def test():                     # no arguments: pytest must not look for fixtures
                pass
            test.__name__, test.__qualname__, test.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
            return pytest.mark.skip(reason="hypothesis is not installed (the test extra)")(test)
        return skipped

__all__ = ["given", "settings", "st"]
