"""The one reader of input files: regular files only, bounded, one-line errors."""
from __future__ import annotations

import os

import pytest

from torchledger.inputs import InputFileError, read_input


def test_reads_a_regular_file(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b'{"schema": "torchledger/1"}')
    assert read_input(p, what="record") == b'{"schema": "torchledger/1"}'


def test_missing_directory_and_limit(tmp_path):
    with pytest.raises(InputFileError, match="no such file; expected a record file"):
        read_input(tmp_path / "nope.json", what="record")
    with pytest.raises(InputFileError, match="is a directory"):
        read_input(tmp_path, what="record")
    p = tmp_path / "big"
    p.write_bytes(b"x" * 101)
    with pytest.raises(InputFileError, match="101 bytes is larger than 100 bytes"):
        read_input(p, max_bytes=100)
    assert read_input(p, max_bytes=101) == b"x" * 101      # the limit itself is allowed


def test_fifo_and_device_are_refused_without_hanging(tmp_path):
    fifo = tmp_path / "x.py"
    os.mkfifo(fifo)                       # nobody writes: an open() for reading would block
    with pytest.raises(InputFileError, match="is a FIFO"):
        read_input(fifo, what="source")
    with pytest.raises(InputFileError, match="is a device"):
        read_input("/dev/zero", what="snapshot")


def test_symlink_to_regular_file_is_followed(tmp_path):
    p = tmp_path / "real.json"
    p.write_bytes(b"{}")
    link = tmp_path / "link.json"
    link.symlink_to(p)
    assert read_input(link) == b"{}"
