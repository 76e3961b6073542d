"""The dequantized GGUF cache is verified, not believed, and the fingerprint cache notices any edit."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from gguf_fixture import write_tiny_gguf  # noqa: E402

from spectrain.io.integrity import sha256  # noqa: E402
from spectrain.targets import fingerprint as F  # noqa: E402
from spectrain.targets import gguf as G  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """One conversion for the module: (the GGUF file, its pristine cache entry)."""
    d = tmp_path_factory.mktemp("gguf-cache")
    src = write_tiny_gguf(d / "tiny.gguf")
    os.environ["SPECTRAIN_CACHE_DIR"] = str(d / "cache")
    try:
        entry = Path(G.resolve_target_path(str(src)))
    finally:
        del os.environ["SPECTRAIN_CACHE_DIR"]
    return src, entry


@pytest.fixture
def entry(made, tmp_path, monkeypatch) -> Path:
    """A private copy of the pristine entry in this test's own cache dir."""
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "cache" / "gguf" / made[1].name
    shutil.copytree(made[1], copy)
    return copy


def current(made, entry) -> bool:
    return G.entry_is_current(entry, sha256(made[0]))


def flip_last_byte(p: Path) -> None:
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x80  # the sign bit of the last fp32 weight: same size, and mtime restored below
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_entry_lists_and_checks_every_file(made, entry):
    listed = {line.split("  ", 1)[1] for line in (entry / "SHA256SUMS").read_text().splitlines()}
    assert {"model.safetensors", "config.json", "tokenizer.json", G.MARKER} <= listed
    assert current(made, entry)


@pytest.mark.parametrize("damage", ["weights", "rope_theta", "planted_template", "missing_file", "no_manifest",
                                    "bad_manifest"])
def test_a_changed_entry_is_stale(made, entry, damage):
    if damage == "weights":
        flip_last_byte(entry / "model.safetensors")
    elif damage == "rope_theta":
        cfg = json.loads((entry / "config.json").read_text())
        cfg["rope_theta"] = 12345.0
        (entry / "config.json").write_text(json.dumps(cfg))
    elif damage == "planted_template":
        (entry / "chat_template.jinja").write_text("{{ 'pwned' }}")  # not a weight file, still not ours
    elif damage == "missing_file":
        (entry / "tokenizer.json").unlink()
    elif damage == "bad_manifest":
        (entry / "SHA256SUMS").write_text("not a manifest line\n")
    else:
        (entry / "SHA256SUMS").unlink()
    with pytest.warns(UserWarning, match=f"{entry}.* failed its check"):
        assert current(made, entry) is False


def test_a_stale_entry_is_re_created_on_load(made, entry):
    good = sha256(entry / "model.safetensors")
    flip_last_byte(entry / "model.safetensors")
    with pytest.warns(UserWarning, match="re-creating it"):
        assert G.resolve_target_path(str(made[0])) == str(entry)
    assert sha256(entry / "model.safetensors") == good and current(made, entry)


def test_links_are_refused_and_left_alone(made, entry, tmp_path):
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(entry / "model.safetensors", elsewhere)
    (entry / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(G.GGUFError, match="model.safetensors is a symbolic link"):
        G.resolve_target_path(str(made[0]))
    assert (entry / "model.safetensors").is_symlink() and elsewhere.is_file()


def test_a_symlinked_entry_is_refused_clearly(made, entry, tmp_path):
    real = tmp_path / "real-entry"
    shutil.move(entry, real)
    entry.symlink_to(real)
    with pytest.raises(G.GGUFError, match="is a symbolic link or a file, not a directory") as e:
        G.resolve_target_path(str(made[0]))
    assert "rmtree" not in str(e.value) and entry.is_symlink() and real.is_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_another_user_owns_is_refused(made, entry):
    os.chown(entry / "config.json", 12345, 12345)
    with pytest.raises(G.GGUFError, match=r"config.json belongs to another user \(uid 12345\)"):
        G.resolve_target_path(str(made[0]))
    assert (entry / "config.json").stat().st_uid == 12345  # refused, not deleted


def test_an_entry_others_can_write_is_refused(made, entry):
    os.chmod(entry, 0o775)
    with pytest.raises(G.GGUFError, match="writable by its group or by other users.*rm -r"):
        G.resolve_target_path(str(made[0]))


# ---- the fingerprint cache: every local target directory -----------------------------------------------------


@pytest.fixture
def target_dir(tmp_path, monkeypatch) -> Path:
    from conftest import make_tiny_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    d = tmp_path / "target"
    make_tiny_model(layers=2).save_pretrained(d)
    return d


def fingerprint(d: Path, calls: list) -> str:
    from transformers import AutoModelForCausalLM

    from spectrain.targets.model import FrozenTarget

    return F.target_fingerprint(FrozenTarget(AutoModelForCausalLM.from_pretrained(d), name_or_path=str(d)))


@pytest.fixture
def calls(monkeypatch) -> list:
    seen, real = [], F._stream_hash
    monkeypatch.setattr(F, "_stream_hash", lambda t: seen.append(1) or real(t))
    return seen


def test_an_edit_that_keeps_size_and_mtime_is_noticed(target_dir, calls, monkeypatch):
    monkeypatch.setattr(F, "RACY_NS", 0)  # the files were written just now: trust them for this test
    first = fingerprint(target_dir, calls)
    assert fingerprint(target_dir, calls) == first and len(calls) == 1  # the cached value was used
    time.sleep(0.05)  # beyond the ctime clock's tick
    weights = target_dir / "model.safetensors"
    before = weights.stat()
    flip_last_byte(weights)
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert fingerprint(target_dir, calls) != first and len(calls) == 2


def test_files_changed_within_the_timestamp_resolution_are_not_cached(target_dir, calls):
    fingerprint(target_dir, calls)
    fingerprint(target_dir, calls)
    assert len(calls) == 2  # written a moment ago: a second edit could keep the ctime, so no record was kept


def test_a_record_another_user_could_write_is_ignored(target_dir, calls, monkeypatch):
    monkeypatch.setattr(F, "RACY_NS", 0)
    fingerprint(target_dir, calls)
    (record,) = (target_dir.parent / "xdg" / "spectrain" / "fingerprints").iterdir()
    assert record.stat().st_mode & 0o777 == 0o600
    os.chmod(record, 0o666)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fingerprint(target_dir, calls)
    assert len(calls) == 2


def test_every_cache_shares_one_root_spectrain_cache_dir_then_xdg_then_home(tmp_path, monkeypatch):
    """A sandbox redirecting XDG_CACHE_HOME catches every cache; SPECTRAIN_CACHE_DIR overrides it (issue 31 CI)."""
    from spectrain.io.cache import cache_root
    from spectrain.targets.auto_dtype import _cache_file

    monkeypatch.delenv("SPECTRAIN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "spectrain"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "spectrain"
    assert _cache_file().parent == cache_root()
    d = tmp_path / "target"
    d.mkdir()
    target = type("T", (), {"name_or_path": str(d)})()
    assert F._cache_key(target)[0].parent == cache_root() / "fingerprints"
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
