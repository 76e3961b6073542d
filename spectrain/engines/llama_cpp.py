"""llama.cpp, pinned: fetched from the package registry, built for this CPU, cached and reused.

    spectrain engine fetch llama.cpp [--jobs N] [--rebuild]     # ~20 min on 2 cores the first time
    spectrain engine info llama.cpp                             # where it is, how it was built

The source is the ``vendor/llama.cpp`` tree of the ``llama-cpp-python`` sdist (MIT), taken by its pinned
sha256 (spectrain/engines/fetch.py explains why pip is not used to get it). Only that tree is unpacked and
only the engine's own CMake build runs. Builds are cached under
``$SPECTRAIN_CACHE_DIR/engines/llama.cpp-<version>-<key>/`` where the key hashes the pin, the ggml options
(from spectrain/engines/cpu.py: what this CPU really executes) and the compiler, so a machine with other
instruction sets gets its own build and never one that dies with SIGILL.

A cached build is verified, not believed, before any of its programs runs (``engine info``, ``eval --engine``,
``export``, ``regenerate --engine`` all go through ``require()``): ``SHA256SUMS`` in the entry lists the sha256 of
the built binaries and of the converter's Python files (written atomically when the build finishes), and the
entry and everything in it must belong to the caller and be writable by no one else (spectrain/io/integrity.py,
the rule the GGUF target cache keeps). A build runs under a lock that its compilers inherit, in its own process
group that is stopped with ``engine fetch``, so no two builds ever share a directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from spectrain.engines.cpu import ggml_cpu_options
from spectrain.engines.fetch import PinnedFile, download, unpack
from spectrain.engines.process import sigterm_exits, stop_group
from spectrain.io.cache import cache_root
from spectrain.io.integrity import MANIFEST, IntegrityError, read_manifest, sha256, untrusted_entries

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is llama.cpp commit 0c1e570 (2026-10)
LLAMA_CPP_COMMIT = "0c1e570"
SDIST = PinnedFile(project="llama-cpp-python", filename=f"llama_cpp_python-{VERSION}.tar.gz",
                   sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e", size=76589250)
BINARIES = ("llama-server", "llama-bench", "llama-speculative-simple")
REBUILD = "rebuild with `spectrain engine fetch llama.cpp --rebuild`"
# No network at build time (the server's web UI would be downloaded) and no TLS / tests / extra tools.
_FIXED = {"CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF", "LLAMA_BUILD_TESTS": "OFF",
          "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF", "LLAMA_CURL": "OFF",
          "GGML_OPENMP": "ON"}


@dataclass(frozen=True)
class Engine:
    """A built llama.cpp: its binaries and the source tree whose converter writes GGUF files."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def binary(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    @property
    def info(self) -> dict:
        return json.loads((self.root / "build.json").read_text())

    @property
    def version(self) -> str:
        return f"llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {VERSION} sdist)"


def cmake_options(cpu: dict[str, bool]) -> dict[str, str]:
    return {**_FIXED, **{k: "ON" if v else "OFF" for k, v in sorted(cpu.items())}}


def _compiler_id() -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise OSError("no C++ compiler found (c++, g++ or clang++): install one, e.g. `apt-get install g++`")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else cxx


def build_key(options: dict[str, str], compiler: str) -> str:
    blob = json.dumps({"sdist": SDIST.sha256, "options": options, "compiler": compiler}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def engines_dir() -> Path:
    return cache_root() / "engines"


class EngineCacheError(ValueError):
    """A cached engine spectrain will not run: damaged, incomplete or not the caller's alone (exit status 2)."""


@contextmanager
def _lock(path: Path):
    """One build per cache entry at a time; a second `engine fetch` waits for the first. Yields the lock's file
    descriptor: the build's children inherit it, so a fetch killed outright (SIGKILL) keeps the lock held until
    its last compiler exits, and a second fetch never builds into the same directory meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another spectrain is building this engine ({path}); waiting for it", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield f.fileno()


def _run_logged(cmd: list[str], log, what: str, bar: tqdm | None = None, lock_fd: int | None = None) -> None:
    """Run a build step, its output to the log; ninja's / make's "[n/m]" lines drive the bar. The step runs in its
    own process group, stopped whole when this process is interrupted or fails (spectrain/engines/process.py)."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, pass_fds=() if lock_fd is None else (lock_fd,))
    try:
        for line in proc.stdout:
            log.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]", line)
            if bar is not None and m:
                bar.total = int(m.group(2))
                bar.n = int(m.group(1))
                bar.refresh()
        proc.wait()
    except BaseException:
        stop_group(proc, grace=5.0)
        raise
    if proc.returncode != 0:
        raise OSError(f"llama.cpp {what} failed (exit {proc.returncode}); see the log {log.name}")


def _build(src: Path, out: Path, options: dict[str, str], jobs: int, lock_fd: int | None = None) -> float:
    for tool in ("cmake",):
        if not shutil.which(tool):
            raise OSError(f"{tool} not found: install it (e.g. `apt-get install cmake ninja-build g++`)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = out / "build"
    t0 = time.monotonic()
    with open(out / "build.log", "w") as log, sigterm_exits():
        _run_logged(["cmake", "-S", str(src), "-B", str(build), *gen,
                     *(f"-D{k}={v}" for k, v in options.items())], log, "configure", lock_fd=lock_fd)
        with tqdm(desc="build llama.cpp", unit="step", dynamic_ncols=True) as bar:
            _run_logged(["cmake", "--build", str(build), "-j", str(jobs), "--target", *BINARIES], log,
                        "build", bar, lock_fd)
    return time.monotonic() - t0


def check_jobs(jobs: int | None) -> int:
    """--jobs in 1..os.cpu_count() (default: every core): more only thrashes the machine, or asks for absurd memory."""
    cores = os.cpu_count() or 1
    if jobs is None:
        return cores
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= cores:
        raise ValueError(f"--jobs {jobs}: give 1 to {cores} (this machine's cores) parallel compile jobs")
    return jobs


def manifested(root: Path) -> list[str]:
    """What spectrain runs from an entry, relative to it: the binaries, and the converter with every Python file it
    may import (its conversion/ and gguf-py/ packages)."""
    py = sorted(p.relative_to(root).as_posix() for p in (root / "src").rglob("*.py") if not p.is_symlink())
    return [f"build/bin/{b}" for b in BINARIES] + py


def write_manifest(root: Path) -> Path:
    """SHA256SUMS of what spectrain runs from the entry (sha256sum format), written atomically."""
    lines = [f"{sha256(root / rel)}  {rel}\n" for rel in manifested(root)]
    tmp = root / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text("".join(lines))
    os.replace(tmp, root / MANIFEST)
    return root / MANIFEST


def _tighten(root: Path) -> None:
    """Nothing in a fresh build writable by group or others (a umask of 002 leaves it so): the ownership check
    would refuse it, and rightly."""
    for dirpath, dirs, names in os.walk(root):
        for p in [Path(dirpath)] + [Path(dirpath) / n for n in dirs + names]:
            st = p.lstat()
            if st.st_mode & 0o022 and not p.is_symlink():
                os.chmod(p, st.st_mode & 0o7755)


def foreign(root: Path) -> str | None:
    """Why an entry is not the caller's alone (a link, another user's file, one others can write), else None."""
    if root.is_symlink():
        return f"{root} is a symbolic link"
    found = untrusted_entries(root)
    return found[0] if found else None


def damage(root: Path) -> str | None:
    """Why an entry of the caller's does not match the SHA256SUMS written when it was built (None: it matches)."""
    try:
        listed = read_manifest(root)
    except IntegrityError as e:
        return str(e)
    if listed is None:
        return f"it has no {MANIFEST} (built by an older spectrain, or its build did not finish)"
    for rel in dict.fromkeys([f"build/bin/{b}" for b in BINARIES] + sorted(listed)):
        p = root / rel
        if rel not in listed:
            return f"{p} is not listed in {root / MANIFEST}"
        if not p.is_file():
            return f"{p} is missing"
        if sha256(p) != listed[rel]:
            return f"{p} differs from the sha256 recorded when it was built (truncated or altered)"
    return None


def _refuse_foreign(root: Path, why: str) -> EngineCacheError:
    return EngineCacheError(f"the cached llama.cpp build {root} is not used: {why}, so someone else could have put the "
                            f"programs spectrain would run as you; remove it (rm -r {root}) and build your own with "
                            "`spectrain engine fetch llama.cpp`, or set SPECTRAIN_CACHE_DIR to a directory of your own")


def verified(engine: Engine) -> Engine:
    """`engine` when its entry is the caller's alone and matches its SHA256SUMS; EngineCacheError naming the cause."""
    why = foreign(engine.root)
    if why:
        raise _refuse_foreign(engine.root, why)
    why = damage(engine.root)
    if why:
        raise EngineCacheError(f"the cached llama.cpp build {engine.root} is not run: {why}; {REBUILD}")
    return engine


def fetch(jobs: int | None = None, rebuild: bool = False) -> Engine:
    """The pinned engine built for this machine: from the cache when it is there (verified), else fetched and
    built. A damaged cached build is refused, not silently rebuilt: ``rebuild`` replaces it."""
    jobs = check_jobs(jobs)
    options = cmake_options(ggml_cpu_options())
    key = build_key(options, _compiler_id())
    root = engines_dir() / f"llama.cpp-{VERSION}-{key}"
    engine = Engine(root)
    with _lock(engines_dir() / f".llama.cpp-{key}.lock") as lock_fd:
        if root.exists() or root.is_symlink():
            why = foreign(root)
            if why:  # never deleted, built into or run
                raise _refuse_foreign(root, why)
            if not rebuild and (root / "build.json").is_file():
                return verified(engine)
        archive = download(SDIST, engines_dir() / "sdist" / SDIST.filename)
        if rebuild and root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        unpack(archive, f"llama_cpp_python-{VERSION}/vendor/llama.cpp", root / "src")
        (root / "build.json").unlink(missing_ok=True)  # absent until this build is complete and sealed
        seconds = _build(root / "src", root, options, jobs, lock_fd)
        missing = [b for b in BINARIES if not engine.binary(b).is_file()]
        if missing:
            raise OSError(f"llama.cpp built without {', '.join(missing)}; see the log {root / 'build.log'}")
        write_manifest(root)
        info = {"version": engine.version, "sdist_sha256": SDIST.sha256, "options": options,
                "compiler": _compiler_id(), "build_seconds": round(seconds, 1), "jobs": jobs}
        tmp = root / "build.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        _tighten(root)  # once every file is made
        os.replace(tmp, root / "build.json")  # last: the entry is complete
    return engine


def cached() -> Engine | None:
    """The engine already built for this machine's options (not yet verified), or None (no fetch, no build)."""
    options = cmake_options(ggml_cpu_options())
    engine = Engine(engines_dir() / f"llama.cpp-{VERSION}-{build_key(options, _compiler_id())}")
    return engine if (engine.root / "build.json").is_file() else None


def require() -> Engine:
    """The cached engine, verified (owner, modes, SHA256SUMS) before any of its programs runs."""
    engine = cached()
    if engine is None:
        raise FileNotFoundError("llama.cpp is not built on this machine: run `spectrain engine fetch llama.cpp` "
                                "(about 20 minutes on 2 cores, once)")
    return verified(engine)


def add_engine_args(p) -> None:
    p.add_argument("action", choices=["fetch", "info"], help="fetch: download, build and cache; info: show the build")
    p.add_argument("name", choices=["llama.cpp"], help="the engine (llama.cpp is the one that runs on CPUs)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs, 1 to the number of cores "
                   "(default: every core)")
    p.add_argument("--rebuild", action="store_true", help="build again even when a cached build exists")


def main(args) -> int:
    check_jobs(args.jobs)
    if args.action == "info":
        engine = require()
    else:
        t0 = time.monotonic()
        engine = fetch(args.jobs, args.rebuild)
        print(f"llama.cpp ready in {time.monotonic() - t0:.0f} s")
    info = engine.info
    on = [k.removeprefix("GGML_") for k, v in info["options"].items() if k.startswith("GGML_") and v == "ON"]
    print(f"{engine.version}\n  binaries: {engine.binary('')}\n  converter: {engine.converter}\n"
          f"  build: {info['build_seconds']} s with {info['jobs']} jobs, {info['compiler']}; ggml: {' '.join(on)}")
    return 0
