"""Atomic writes (localgen/fileio.py) and the writers that use them: a write that fails at any
step leaves the old file whole and no temp file behind; the error names the path. And the
writable-folder check the commands run before slow work.

Tests run as root, where a chmod'ed folder still takes writes: failures are injected by
monkeypatching (os.replace, os.write, os.access) or by a path under a regular file."""

from __future__ import annotations

import errno
import json
import os

import pytest

from localgen import fileio
from localgen.fileio import atomic_write_json, atomic_write_text, check_writable_dir


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_writes_and_replaces(tmp_path):
    p = tmp_path / "a.txt"
    assert atomic_write_text(p, "one") == p and p.read_text() == "one"
    atomic_write_text(p, "two ü")
    assert p.read_text(encoding="utf-8") == "two ü" and leftovers(tmp_path) == []


def test_old_content_survives_a_failed_rename(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"v": 1})

    def fail(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match=f"cannot write {p}"):
        atomic_write_json(p, {"v": 2})
    assert json.loads(p.read_text()) == {"v": 1} and leftovers(tmp_path) == []


def test_old_content_survives_a_full_disk_mid_write(tmp_path, monkeypatch):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "old")
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 3:
            return real_write(fd, bytes(data[:3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match=f"cannot write {p}: No space left") as e:
        atomic_write_text(p, "new and longer")
    assert e.value.errno == errno.ENOSPC
    assert p.read_text() == "old" and leftovers(tmp_path) == []


def test_an_interrupt_mid_write_removes_the_temp_file(tmp_path, monkeypatch):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "old")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(p, "new")
    assert p.read_text() == "old" and leftovers(tmp_path) == []


def test_json_that_cannot_serialise_leaves_the_file_untouched(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, [1])
    with pytest.raises(TypeError):
        atomic_write_json(p, {"x": object()})
    assert json.loads(p.read_text()) == [1] and leftovers(tmp_path) == []


def test_missing_folder_names_the_path(tmp_path):
    p = tmp_path / "no" / "a.txt"
    with pytest.raises(FileNotFoundError, match=f"cannot write {p}"):
        atomic_write_text(p, "x")


def test_keeps_an_existing_files_mode_and_takes_a_given_one(tmp_path):
    p = tmp_path / "private.json"
    p.write_text("{}")
    p.chmod(0o600)
    atomic_write_json(p, {"a": 1})
    assert p.stat().st_mode & 0o777 == 0o600
    q = atomic_write_text(tmp_path / "new.txt", "x", mode=0o640)
    assert q.stat().st_mode & 0o777 == 0o640 & ~current_umask()


def current_umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_check_writable_dir_creates_a_missing_folder(tmp_path):
    d = tmp_path / "a" / "b"
    check_writable_dir(d)
    assert d.is_dir()


def test_check_writable_dir_under_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(NotADirectoryError, match=str(f)):
        check_writable_dir(f / "sub")
    with pytest.raises(NotADirectoryError, match=f"{f} is not a folder"):
        check_writable_dir(f)


def test_check_writable_dir_refuses_a_read_only_folder(tmp_path, monkeypatch):
    # root writes through a chmod'ed folder, so the kernel's answer is replaced instead
    monkeypatch.setattr(fileio.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=f"cannot write in the folder {tmp_path}"):
        check_writable_dir(tmp_path)


def writers(tmp_path):
    """(write, the files it writes): each of localgen's whole-file writers."""
    from localgen.conversation import Conversation
    from localgen.kernels.dispatch import GemmDispatchTable
    from localgen.policy import Policy, save_policy
    from localgen.policy.store import policy_path
    from localgen.profiler.hardware import load_profile

    hw = load_profile("cpu_2core")
    conv = Conversation(system="be brief")
    return {
        "profile": (lambda: hw.save(tmp_path / "hw.json"), [tmp_path / "hw.json"]),
        "policy": (lambda: save_policy("m", Policy(gbs=4, wg=0.5, wc=0.5)), [policy_path("m")]),
        "transcript": (lambda: conv.save(tmp_path / "chat"),
                       [tmp_path / "chat.md", tmp_path / "chat.json"]),
        "gemm table": (lambda: GemmDispatchTable({(8, 8): (1, 2)}).save(str(tmp_path / "g.json")),
                       [tmp_path / "g.json"]),
    }


@pytest.mark.parametrize("name", ["profile", "policy", "transcript", "gemm table"])
@pytest.mark.parametrize("failing", [0, -1])  # the first or the last rename of the writer
def test_every_writer_keeps_the_old_file_when_a_write_fails(name, failing, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "cfg"))
    write, paths = writers(tmp_path)[name]
    write()
    before = [p.read_bytes() for p in paths]
    real_replace = os.replace

    def fail_on(src, dst):
        if os.fspath(dst) == os.fspath(paths[failing]):
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on)
    with pytest.raises(OSError, match=f"cannot write {paths[failing]}"):
        write()
    assert [p.read_bytes() for p in paths] == before
    assert all(leftovers(p.parent) == [] for p in paths)
