"""Atomic text files (kfac_hpc.files): a reader sees the old file or the new, never a part."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import kfac_hpc.plan.profile as profile_module
from kfac_hpc.files import write_text_atomic
from kfac_hpc.plan.profile import default_profile, load_profile


def test_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "profile.json"
    assert write_text_atomic(target, "one\n") == target
    write_text_atomic(target, "two\n")
    assert target.read_text() == "two\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["profile.json"]


@pytest.mark.parametrize("umask", [0o022, 0o007, 0o077])
def test_a_new_file_gets_the_mode_open_gives_and_a_replaced_one_keeps_its_own(
        tmp_path: Path, umask: int) -> None:
    """0666 less the umask, as ``open`` gives (a temporary file's 0600 would hide a
    shared profile from the group); a file replaced keeps its mode."""
    before = os.umask(umask)
    try:
        new = write_text_atomic(tmp_path / "new.json", "{}\n")
        plain = tmp_path / "plain.json"
        plain.write_text("{}\n")
        assert stat.S_IMODE(new.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
        assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
        new.chmod(0o640)
        write_text_atomic(new, "[]\n")
        assert stat.S_IMODE(new.stat().st_mode) == 0o640
    finally:
        os.umask(before)


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"
    write_text_atomic(target, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "half written \ud800")  # not encodable: fails mid-write
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


def test_profiles_are_saved_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[Path] = []

    def spy(path: Path, text: str) -> Path:
        written.append(Path(path))
        return write_text_atomic(path, text)

    monkeypatch.setattr(profile_module, "write_text_atomic", spy)
    profile = default_profile()
    path = profile.save(tmp_path / "p.json")
    assert written == [tmp_path / "p.json"]
    assert load_profile(path).to_json() == profile.to_json()
