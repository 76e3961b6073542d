"""llama.cpp, pinned: fetched from the package registry, built for this CPU, cached and reused.

    spectrain engine fetch llama.cpp [--jobs N] [--rebuild]     # ~20 min on 2 cores the first time
    spectrain engine info llama.cpp                             # where it is, how it was built

The source is the ``vendor/llama.cpp`` tree of the ``llama-cpp-python`` sdist (MIT), taken by its pinned
sha256 (spectrain/engines/fetch.py explains why pip is not used to get it). Only that tree is unpacked and
only the engine's own CMake build runs. Builds are cached under
``$SPECTRAIN_CACHE_DIR/engines/llama.cpp-<version>-<key>/`` where the key hashes the pin, the ggml options
(from spectrain/engines/cpu.py: what this CPU really executes) and the compiler, so a machine with other
instruction sets gets its own build and never one that dies with SIGILL.
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
from spectrain.io.cache import cache_root

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is llama.cpp commit 0c1e570 (2026-10)
LLAMA_CPP_COMMIT = "0c1e570"
SDIST = PinnedFile(project="llama-cpp-python", filename=f"llama_cpp_python-{VERSION}.tar.gz",
                   sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e", size=76589250)
BINARIES = ("llama-server", "llama-bench", "llama-speculative-simple")
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


@contextmanager
def _lock(path: Path):
    """One build per cache entry at a time; a second `engine fetch` waits for the first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another spectrain is building this engine ({path}); waiting for it", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _run_logged(cmd: list[str], log, what: str, bar: tqdm | None = None) -> None:
    """Run a build step, its output to the log; ninja's / make's "[n/m]" lines drive the bar."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.write(line)
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if bar is not None and m:
            bar.total = int(m.group(2))
            bar.n = int(m.group(1))
            bar.refresh()
    if proc.wait() != 0:
        raise OSError(f"llama.cpp {what} failed (exit {proc.returncode}); see the log {log.name}")


def _build(src: Path, out: Path, options: dict[str, str], jobs: int) -> float:
    for tool in ("cmake",):
        if not shutil.which(tool):
            raise OSError(f"{tool} not found: install it (e.g. `apt-get install cmake ninja-build g++`)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = out / "build"
    t0 = time.monotonic()
    with open(out / "build.log", "w") as log:
        _run_logged(["cmake", "-S", str(src), "-B", str(build), *gen,
                     *(f"-D{k}={v}" for k, v in options.items())], log, "configure")
        with tqdm(desc="build llama.cpp", unit="step", dynamic_ncols=True) as bar:
            _run_logged(["cmake", "--build", str(build), "-j", str(jobs), "--target", *BINARIES], log,
                        "build", bar)
    return time.monotonic() - t0


def fetch(jobs: int | None = None, rebuild: bool = False) -> Engine:
    """The pinned engine built for this machine: from the cache when it is there, else fetched and built."""
    options = cmake_options(ggml_cpu_options())
    key = build_key(options, _compiler_id())
    root = engines_dir() / f"llama.cpp-{VERSION}-{key}"
    engine = Engine(root)
    with _lock(engines_dir() / f".llama.cpp-{key}.lock"):
        if not rebuild and (root / "build.json").is_file() and all(engine.binary(b).is_file() for b in BINARIES):
            return engine
        archive = download(SDIST, engines_dir() / "sdist" / SDIST.filename)
        if rebuild and root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        unpack(archive, f"llama_cpp_python-{VERSION}/vendor/llama.cpp", root / "src")
        seconds = _build(root / "src", root, options, jobs or os.cpu_count() or 1)
        missing = [b for b in BINARIES if not engine.binary(b).is_file()]
        if missing:
            raise OSError(f"llama.cpp built without {', '.join(missing)}; see the log {root / 'build.log'}")
        info = {"version": engine.version, "sdist_sha256": SDIST.sha256, "options": options,
                "compiler": _compiler_id(), "build_seconds": round(seconds, 1), "jobs": jobs or os.cpu_count()}
        tmp = root / "build.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, root / "build.json")
    return engine


def cached() -> Engine | None:
    """The engine already built for this machine's options, or None (no fetch, no build)."""
    options = cmake_options(ggml_cpu_options())
    engine = Engine(engines_dir() / f"llama.cpp-{VERSION}-{build_key(options, _compiler_id())}")
    return engine if (engine.root / "build.json").is_file() else None


def require() -> Engine:
    engine = cached()
    if engine is None:
        raise FileNotFoundError("llama.cpp is not built on this machine: run `spectrain engine fetch llama.cpp` "
                                "(about 20 minutes on 2 cores, once)")
    return engine


def add_engine_args(p) -> None:
    p.add_argument("action", choices=["fetch", "info"], help="fetch: download, build and cache; info: show the build")
    p.add_argument("name", choices=["llama.cpp"], help="the engine (llama.cpp is the one that runs on CPUs)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    p.add_argument("--rebuild", action="store_true", help="build again even when a cached build exists")


def main(args) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
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
