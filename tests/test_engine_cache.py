"""The built-engine cache is verified, not believed (spectrain/engines/llama_cpp.py), without the real engine: fake
binaries and a fake cmake. A build seals SHA256SUMS of what spectrain runs; a truncated, missing or altered file, a
missing manifest, an entry another user owns or others can write are refused before anything runs; --jobs is
bounded; a SIGTERM to `engine fetch` stops the build's whole process tree, and a fetch killed outright keeps the
build lock until its last compiler exits, so a second fetch never builds into the same directory."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spectrain.cli import main as cli_main
from spectrain.engines import llama_cpp

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECTRAIN_DEBUG", raising=False)


@pytest.fixture
def entry(monkeypatch) -> Path:
    """Where this machine's build lives (CPU probes and compiler faked: fast)."""
    monkeypatch.setattr(llama_cpp, "ggml_cpu_options", lambda: {"GGML_NATIVE": False, "GGML_AVX2": True})
    monkeypatch.setattr(llama_cpp, "_compiler_id", lambda: "fake c++ 1.0")
    opts = llama_cpp.cmake_options({"GGML_NATIVE": False, "GGML_AVX2": True})
    return llama_cpp.engines_dir() / f"llama.cpp-{llama_cpp.VERSION}-{llama_cpp.build_key(opts, 'fake c++ 1.0')}"


def make_build(root: Path) -> Path:
    """What a finished fetch leaves: binaries, the converter's Python, SHA256SUMS, build.json."""
    for b in llama_cpp.BINARIES:
        exe = root / "build" / "bin" / b
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(f"#!/bin/sh\necho {b}\n")
        exe.chmod(0o755)
    (root / "src" / "gguf-py" / "gguf").mkdir(parents=True)
    (root / "src" / "convert_hf_to_gguf.py").write_text("print('convert')\n")
    (root / "src" / "gguf-py" / "gguf" / "__init__.py").write_text("")
    llama_cpp._tighten(root)
    llama_cpp.write_manifest(root)
    (root / "build.json").write_text(json.dumps({"options": {"GGML_AVX2": "ON"}, "build_seconds": 1.0, "jobs": 2,
                                                 "compiler": "fake c++ 1.0"}))
    return root


def one_line(err: str, *words: str) -> None:
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], err


def no_build(monkeypatch) -> None:
    monkeypatch.setattr(llama_cpp, "download", lambda *a, **k: pytest.fail("a build started"))


def test_a_sealed_build_lists_what_spectrain_runs_and_is_used(entry, capsys):
    make_build(entry)
    listed = (entry / "SHA256SUMS").read_text()
    for rel in ["build/bin/llama-server", "build/bin/llama-bench", "src/convert_hf_to_gguf.py",
                "src/gguf-py/gguf/__init__.py"]:
        assert f"  {rel}\n" in listed
    assert llama_cpp.require().root == entry
    assert cli_main(["engine", "info", "llama.cpp"]) == 0 and str(entry) in capsys.readouterr().out


@pytest.mark.parametrize("damage,words", [
    (lambda r: (r / "build/bin/llama-server").write_text("#!/bin/sh\n"), ["llama-server", "truncated or altered"]),
    (lambda r: (r / "build/bin/llama-bench").unlink(), ["llama-bench is missing"]),
    (lambda r: (r / "src/convert_hf_to_gguf.py").write_text("import os\n"), ["convert_hf_to_gguf.py"]),
    (lambda r: (r / "SHA256SUMS").unlink(), ["no SHA256SUMS", "older spectrain"]),
    (lambda r: (r / "SHA256SUMS").write_text("junk\n"), ["malformed"]),
])
def test_a_damaged_build_is_refused_by_info_eval_export_and_fetch(entry, damage, words, capsys, monkeypatch):
    damage(make_build(entry))
    rebuild = "spectrain engine fetch llama.cpp --rebuild"
    with pytest.raises(llama_cpp.EngineCacheError, match="--rebuild"):
        llama_cpp.require()  # what eval --engine, export and regenerate --engine call before running anything
    no_build(monkeypatch)
    with pytest.raises(llama_cpp.EngineCacheError, match="--rebuild"):
        llama_cpp.fetch()  # not called healthy, and not silently rebuilt either
    assert cli_main(["engine", "info", "llama.cpp"]) == 2
    one_line(capsys.readouterr().err, rebuild, *words)


def test_an_entry_others_can_write_is_refused_and_never_deleted_by_rebuild(entry, capsys, monkeypatch):
    make_build(entry)
    os.chmod(entry / "build" / "bin" / "llama-server", 0o777)
    with pytest.raises(llama_cpp.EngineCacheError, match="writable by its group or by other users.*rm -r"):
        llama_cpp.require()
    no_build(monkeypatch)
    assert cli_main(["engine", "fetch", "llama.cpp", "--rebuild"]) == 2
    one_line(capsys.readouterr().err, "llama-server is writable", "SPECTRAIN_CACHE_DIR")
    assert (entry / "build" / "bin" / "llama-server").is_file()  # refused, left alone


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_another_user_owns_is_refused(entry):
    make_build(entry)
    os.chown(entry / "src" / "convert_hf_to_gguf.py", 12345, 12345)
    with pytest.raises(llama_cpp.EngineCacheError, match=r"belongs to another user \(uid 12345\)"):
        llama_cpp.require()


def test_a_symlinked_entry_is_refused(entry, tmp_path):
    real = make_build(tmp_path / "elsewhere")
    entry.parent.mkdir(parents=True)
    entry.symlink_to(real)
    with pytest.raises(llama_cpp.EngineCacheError, match="symbolic link"):
        llama_cpp.require()


@pytest.mark.parametrize("jobs", ["0", "-2", str((os.cpu_count() or 1) + 1), "100000"])
def test_jobs_outside_one_to_the_cores_are_refused_before_anything(jobs, capsys, monkeypatch):
    no_build(monkeypatch)
    monkeypatch.setattr(llama_cpp, "fetch", lambda *a, **k: pytest.fail("a build started"))
    assert cli_main(["engine", "fetch", "llama.cpp", "--jobs", jobs]) == 2
    one_line(capsys.readouterr().err, f"--jobs {jobs}", f"1 to {os.cpu_count()}")
    with pytest.raises(ValueError, match="--jobs"):
        llama_cpp.check_jobs(True)


FAKE_CMAKE = """#!/bin/sh
echo "$*" >> "$FAKE_CMAKE_CALLS"
if [ "$1" = --build ]; then
  if [ -n "$FAKE_CMAKE_HANG" ]; then
    echo $$ > "$FAKE_CMAKE_HANG.pid"; sleep 60 & echo $! > "$FAKE_CMAKE_HANG.child"; wait; exit 0
  fi
  mkdir -p "$2/bin"; for b in llama-server llama-bench llama-speculative-simple; do
    printf '#!/bin/sh\\necho %s\\n' $b > "$2/bin/$b"; chmod 755 "$2/bin/$b"; done
fi
"""


@pytest.fixture
def fake_cmake(tmp_path, monkeypatch) -> Path:
    """cmake on PATH is a script: configure does nothing, --build writes the three binaries (or hangs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CMAKE_CALLS", str(tmp_path / "calls"))
    return tmp_path / "calls"


def _fake_sources(monkeypatch) -> None:
    def unpack(archive, prefix, dest):
        (dest / "gguf-py").mkdir(parents=True, exist_ok=True)
        (dest / "convert_hf_to_gguf.py").write_text("print('convert')\n")
        return dest

    monkeypatch.setattr(llama_cpp, "download", lambda pin, dest: dest)
    monkeypatch.setattr(llama_cpp, "unpack", unpack)


def test_fetch_seals_its_build_and_a_second_fetch_reuses_it_verified(entry, fake_cmake, monkeypatch):
    _fake_sources(monkeypatch)
    old = os.umask(0o002)  # a umask that leaves group-writable files: the build is tightened before it is sealed
    try:
        engine = llama_cpp.fetch(jobs=1)
    finally:
        os.umask(old)
    assert engine.root == entry and llama_cpp.require().root == entry
    assert "build/bin/llama-speculative-simple" in (entry / "SHA256SUMS").read_text()
    calls = fake_cmake.read_text().splitlines()
    assert len(calls) == 2 and "-j 1 " in calls[1]
    llama_cpp.fetch()
    assert len(fake_cmake.read_text().splitlines()) == 2  # reused, not rebuilt


SCRIPT = """import os, sys
sys.path.insert(0, {tests!r})
from spectrain.engines import llama_cpp
llama_cpp.ggml_cpu_options = lambda: {{"GGML_NATIVE": False}}
llama_cpp._compiler_id = lambda: "fake"
llama_cpp.download = lambda pin, dest: dest
llama_cpp.unpack = lambda archive, prefix, dest: (dest.mkdir(parents=True, exist_ok=True), dest)[1]
llama_cpp.fetch(jobs=1)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, seconds: float = 30) -> int:
    deadline = time.monotonic() + seconds
    while not (path.is_file() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def _hung_fetch(tmp_path, fake_cmake) -> tuple[subprocess.Popen, int, int]:
    env = {**os.environ, "FAKE_CMAKE_HANG": str(tmp_path / "hang"), "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))], env=env,
                         stderr=subprocess.DEVNULL)
    return p, _wait_for(tmp_path / "hang.pid"), _wait_for(tmp_path / "hang.child")


def test_sigterm_to_engine_fetch_stops_the_whole_build(tmp_path, fake_cmake):
    p, cmake, child = _hung_fetch(tmp_path, fake_cmake)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while (_alive(cmake) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(cmake) and not _alive(child)


def test_a_fetch_killed_outright_keeps_the_lock_until_its_build_is_gone(tmp_path, fake_cmake):
    p, cmake, child = _hung_fetch(tmp_path, fake_cmake)
    try:
        p.kill()  # SIGKILL: no handler runs, the build's processes are orphaned
        p.wait(30)
        (lock,) = (tmp_path / "cache" / "engines").glob(".llama.cpp-*.lock")
        with open(lock) as f:
            with pytest.raises(BlockingIOError):  # a second fetch would wait, not build into the same directory
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.killpg(cmake, signal.SIGKILL)  # the orphaned build (our own fake), stopped by its group
            deadline = time.monotonic() + 10
            while True:  # free once the build is gone (each of its processes closes the lock as it exits)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the build lock outlived the build"
                    time.sleep(0.05)
    finally:
        for pid in (cmake, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
