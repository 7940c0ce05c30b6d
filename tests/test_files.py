"""Atomic text files (kfac_hpc.files): a reader sees the old file or the new, never a part."""

from __future__ import annotations

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
