"""write_atomic's temporary file lies beside the file it replaces (same directory, so the
final rename never crosses a filesystem), for a plain path and through a symbolic link."""
from __future__ import annotations

import os

import pytest

from torchledger.render import write_atomic


@pytest.fixture
def renames(monkeypatch):
    """Every (source, destination) of os.replace / os.rename during the test."""
    seen = []
    for name in ("replace", "rename"):
        real = getattr(os, name)

        def spy(src, dst, *a, _real=real, **k):
            seen.append((os.fspath(src), os.fspath(dst)))
            return _real(src, dst, *a, **k)
        monkeypatch.setattr(os, name, spy)
    return seen


def test_temporary_file_is_made_beside_the_target(tmp_path, renames):
    target = tmp_path / "out" / "report.json"
    target.parent.mkdir()
    write_atomic(target, '{"a": 1}\n')
    assert target.read_text() == '{"a": 1}\n'
    (src, dst), = renames
    assert dst == str(target)
    assert os.path.dirname(src) == str(target.parent)
    assert os.path.basename(src).startswith(".report.json.") and src.endswith(".tmp")
    assert sorted(os.listdir(target.parent)) == ["report.json"]      # the temporary is gone


def test_through_a_link_the_temporary_is_beside_the_links_target(tmp_path, renames):
    real_dir, link_dir = tmp_path / "real", tmp_path / "links"
    real_dir.mkdir()
    link_dir.mkdir()
    (real_dir / "r.md").write_text("old")
    os.symlink(real_dir / "r.md", link_dir / "r.md")
    write_atomic(link_dir / "r.md", "new")
    (src, dst), = renames
    assert (os.path.dirname(src), dst) == (str(real_dir), str(real_dir / "r.md"))
    assert os.path.islink(link_dir / "r.md") and (real_dir / "r.md").read_text() == "new"
