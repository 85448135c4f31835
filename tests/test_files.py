"""files.py: atomic writes, durable renames, JSON objects read with errors that name the file, and
the temporaries of processes that are gone."""

import os

import pytest

from files import read_config_json, remove_stale_temporaries, sync_rename, write_atomically


def test_an_atomic_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "deep" / "record.json"
    write_atomically(target, "first\n")
    write_atomically(target, "second\n")
    assert target.read_text() == "second\n" and sorted(p.name for p in target.parent.iterdir()) == [
        "record.json"
    ]


@pytest.mark.parametrize(
    "written, message",
    [
        (b"{not json", "cannot read JSON"),
        (b"\xff\xfe", "cannot read JSON"),
        (b"[1, 2]", "expected a JSON object, got a list"),
    ],
)
def test_json_objects_are_read_with_errors_naming_the_file(tmp_path, written, message):
    (tmp_path / "config.json").write_bytes(written)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: {message}"):
        read_config_json(tmp_path)  # a directory means its config.json
    assert read_config_json({"a": 1}) == ({"a": 1}, "config")


def test_a_durable_rename_moves_the_directory(tmp_path):
    (tmp_path / "work.tmp").mkdir()
    sync_rename(tmp_path / "work.tmp", tmp_path / "work")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_only_temporaries_of_processes_that_are_gone_are_removed(tmp_path):
    """pid 4194304 is above Linux's pid_max: no such process. This process's own folder stays."""
    for pid in (4194304, os.getpid()):
        (tmp_path / f".out.tmp-{pid}-x").mkdir()
    remove_stale_temporaries(tmp_path, ".out.tmp-")
    assert [p.name for p in tmp_path.iterdir()] == [f".out.tmp-{os.getpid()}-x"]
