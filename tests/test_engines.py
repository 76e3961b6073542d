"""spectrain/engines without the real engine: the pinned fetch against a local file:// simple index, the safe
unpack, the CPU probes (a claimed AVX-512 that faults here is off), the build cache and its errors, and
LlamaServer against a fake llama-server (tests/fake_llama_server.py). No network; SPECTRAIN_CACHE_DIR is tmp."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import fake_llama_server as fake
import pytest

from spectrain.engines import cpu, fetch, llama_cpp
from spectrain.engines.server import LlamaServer

DATA = bytes(range(256)) * 40
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECTRAIN_DEBUG", raising=False)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def pin(data: bytes = DATA, **kw) -> fetch.PinnedFile:
    return fetch.PinnedFile(**{"project": "Demo_Pkg", "filename": "demo-1.0.tar.gz", "sha256": sha(data),
                               "size": len(data), **kw})


@pytest.fixture
def index(tmp_path, monkeypatch) -> str:
    """A PEP 503 file:// index (directories with index.html, as pip reads them) serving DATA; pip's only index."""
    root = tmp_path / "index"
    (root / "files").mkdir(parents=True)
    (root / "files" / "demo-1.0.tar.gz").write_bytes(DATA)
    (root / "simple" / "demo-pkg").mkdir(parents=True)
    (root / "simple" / "demo-pkg" / "index.html").write_text(
        f'<html><body><a href="../../files/demo-1.0.tar.gz#sha256={sha(DATA)}">demo-1.0.tar.gz</a></body></html>')
    url = (root / "simple").as_uri()
    monkeypatch.setenv("PIP_INDEX_URL", url)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")  # not the sandbox's own extra indexes
    return url


def leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith((".part-", ".unpack-"))] if d.is_dir() else []


# fetch ------------------------------------------------------------------------------------------------------

def test_index_urls_come_from_pips_configuration_env_first_then_extras(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///primary/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///second/simple file:///third/simple")
    assert fetch.index_urls() == ["file:///primary/simple", "file:///second/simple", "file:///third/simple"]


def test_download_from_a_file_index_lands_the_pinned_bytes(index, tmp_path):
    dest = tmp_path / "dl" / "demo-1.0.tar.gz"
    assert fetch.download(pin(), dest) == dest
    assert dest.read_bytes() == DATA and leftovers(dest.parent) == []


def test_a_wrong_pinned_sha256_is_refused_naming_both_hashes(index, tmp_path):
    dest = tmp_path / "dl" / "demo-1.0.tar.gz"
    with pytest.raises(OSError) as e:
        fetch.download(pin(sha256="0" * 64), dest)
    assert sha(DATA) in str(e.value) and "0" * 64 in str(e.value)
    assert not dest.exists() and leftovers(dest.parent) == []


def test_more_bytes_than_the_pinned_size_are_refused(index, tmp_path):
    dest = tmp_path / "dl" / "demo-1.0.tar.gz"
    with pytest.raises(OSError, match="more than the pinned"):
        fetch.download(pin(size=len(DATA) - 1), dest)
    assert not dest.exists() and leftovers(dest.parent) == []


def test_a_file_the_index_does_not_list_names_the_index(index, tmp_path):
    with pytest.raises(OSError, match="not listed") as e:
        fetch.download(pin(filename="demo-2.0.tar.gz"), tmp_path / "dl" / "x")
    assert index in str(e.value)


def test_a_verified_dest_is_reused_without_asking_any_index(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "nowhere").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")

    def no_network(*a, **k):
        raise AssertionError("the index was asked")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    dest = tmp_path / "demo-1.0.tar.gz"
    dest.write_bytes(DATA)
    before = dest.stat().st_mtime_ns
    assert fetch.download(pin(), dest) == dest and dest.stat().st_mtime_ns == before


def test_a_tampered_dest_is_fetched_again(index, tmp_path):
    dest = tmp_path / "demo-1.0.tar.gz"
    dest.write_bytes(b"tampered" + DATA[8:])
    fetch.download(pin(), dest)
    assert dest.read_bytes() == DATA


def test_a_symlink_at_dest_is_refused_and_its_target_untouched(index, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    dest = tmp_path / "demo-1.0.tar.gz"
    dest.symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        fetch.download(pin(), dest)
    assert target.read_bytes() == b"keep" and dest.is_symlink()


def make_tar(path: Path, files: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, to in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, to
            tar.addfile(info)
    return path


def test_unpack_extracts_only_the_members_under_the_prefix(tmp_path):
    archive = make_tar(tmp_path / "a.tar.gz", {"pkg-1/setup.py": b"import os", "pkg-1/vendor/eng/CMakeLists.txt": b"c",
                                               "pkg-1/vendor/eng/src/a.c": b"a", "pkg-1/vendor/other.c": b"o",
                                               "pkg-1/vendor/engine2/b.c": b"b"})
    dest = tmp_path / "out" / "src"
    dest.parent.mkdir()
    assert fetch.unpack(archive, "pkg-1/vendor/eng/", dest) == dest
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["CMakeLists.txt", "src/a.c"] and leftovers(dest.parent) == []


@pytest.mark.parametrize("member,link", [("pkg-1/eng/../../../evil", None), ("pkg-1/eng/evil", "../../../evil"),
                                         ("pkg-1/eng/evil", "/etc/passwd")])
def test_unpack_refuses_members_and_links_that_leave_dest(tmp_path, member, link):
    files = {"pkg-1/eng/ok.c": b"ok"} | ({} if link else {member: b"evil"})
    archive = make_tar(tmp_path / "a.tar.gz", files, {member: link} if link else None)
    dest = tmp_path / "a" / "b" / "src"
    dest.parent.mkdir(parents=True)
    with pytest.raises(tarfile.FilterError):
        fetch.unpack(archive, "pkg-1/eng", dest)
    assert [p for p in tmp_path.rglob("*evil*")] == [] and not dest.exists() and leftovers(dest.parent) == []


def test_unpack_of_an_archive_without_the_prefix_is_refused(tmp_path):
    archive = make_tar(tmp_path / "a.tar.gz", {"other-1/x.c": b"x"})
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="holds no pkg-1/eng/"):
        fetch.unpack(archive, "pkg-1/eng", tmp_path / "out" / "src")
    assert list((tmp_path / "out").iterdir()) == []


# cpu --------------------------------------------------------------------------------------------------------

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu avx512f\n"


def test_cpu_flags_are_the_first_cpus():
    assert cpu.cpu_flags(CPUINFO) == {"fpu", "sse4_2", "avx2"}
    assert cpu.cpu_flags("processor\t: 0\n") == set()


@pytest.mark.skipif(not X86, reason="x86-64 probes")
def test_a_cpu_claiming_nothing_gets_every_option_off_and_no_amx():
    opts = cpu.ggml_cpu_options(cpuinfo="processor\t: 0\nflags\t\t:\n")
    assert set(opts) == {"GGML_NATIVE", *cpu._PROBES, "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}
    assert not any(opts.values())


@pytest.fixture
def probe_runs(monkeypatch) -> list[int]:
    """Exit codes of the probe executables ggml_cpu_options ran (compiles excluded)."""
    codes, real = [], subprocess.run

    def run(cmd, *a, **k):
        done = real(cmd, *a, **k)
        if Path(cmd[0]).name == "probe":
            codes.append(done.returncode)
        return done

    monkeypatch.setattr(subprocess, "run", run)
    return codes


@pytest.mark.skipif(not X86 or "avx512f" in cpu.cpu_flags(), reason="needs an x86 CPU without AVX-512")
def test_claimed_avx512_that_faults_here_is_off(probe_runs):
    opts = cpu.ggml_cpu_options(cpuinfo="flags\t\t: avx512f avx512_bf16 avx512_vnni\n")
    assert not (opts["GGML_AVX512"] or opts["GGML_AVX512_BF16"] or opts["GGML_AVX512_VNNI"])
    assert probe_runs == [-signal.SIGILL] * 3  # compiled, ran, and died: the CPU, not the compiler, said no


@pytest.mark.skipif(not X86 or "avx2" not in cpu.cpu_flags(), reason="needs an x86 CPU with AVX2")
def test_claimed_avx2_that_runs_here_is_on(probe_runs):
    opts = cpu.ggml_cpu_options(cpuinfo="flags\t\t: avx2\n")
    assert opts["GGML_AVX2"] and not opts["GGML_AVX"] and probe_runs == [0]


# llama_cpp --------------------------------------------------------------------------------------------------

def test_build_key_follows_options_and_compiler_only():
    opts = llama_cpp.cmake_options({"GGML_AVX2": True, "GGML_AVX512": False})
    key = llama_cpp.build_key(opts, "gcc 12")
    assert llama_cpp.build_key(dict(opts), "gcc 12") == key
    assert llama_cpp.build_key({**opts, "GGML_AVX512": "ON"}, "gcc 12") != key
    assert llama_cpp.build_key(opts, "gcc 13") != key


@pytest.fixture
def this_machine(monkeypatch):
    monkeypatch.setattr(llama_cpp, "ggml_cpu_options", lambda: {"GGML_NATIVE": False, "GGML_AVX2": True})
    monkeypatch.setattr(llama_cpp, "_compiler_id", lambda: "fake c++ 1.0")
    opts = llama_cpp.cmake_options({"GGML_NATIVE": False, "GGML_AVX2": True})
    return llama_cpp.engines_dir() / f"llama.cpp-{llama_cpp.VERSION}-{llama_cpp.build_key(opts, 'fake c++ 1.0')}"


def test_an_empty_cache_has_no_engine_and_require_says_how_to_build(this_machine):
    assert llama_cpp.cached() is None
    with pytest.raises(FileNotFoundError, match="spectrain engine fetch llama.cpp"):
        llama_cpp.require()


def test_a_cached_build_is_found_and_info_prints_it(this_machine, capsys):
    from test_engine_cache import make_build

    make_build(this_machine)  # sealed: binaries + SHA256SUMS (tests/test_engine_cache.py: a damaged one is refused)
    (this_machine / "build.json").write_text('{"options": {"GGML_AVX2": "ON", "GGML_AMX_TILE": "OFF"}, '
                                             '"build_seconds": 1.0, "jobs": 2, "compiler": "fake c++ 1.0"}')
    assert llama_cpp.require().root == this_machine
    assert llama_cpp.main(argparse.Namespace(action="info", name="llama.cpp", jobs=None, rebuild=False)) == 0
    out = capsys.readouterr().out
    assert "ggml: AVX2" in out and "AMX" not in out and str(this_machine) in out


def test_build_without_cmake_says_how_to_install_it(tmp_path, monkeypatch):
    which = llama_cpp.shutil.which
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name, *a, **k: None if name == "cmake" else which(name))
    with pytest.raises(OSError, match=r"cmake not found.*apt-get install cmake"):
        llama_cpp._build(tmp_path / "src", tmp_path, {}, 1)


def fake_tool(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + script)
    (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("step,script", [
    ("configure", 'echo "CMake Error: fake failure $*"; exit 3\n'),
    ("build", 'if [ "$1" = --build ]; then echo "[1/9] cc a.c"; echo "CMake Error: fake failure"; exit 3; fi\n')])
def test_a_failing_build_names_its_log_which_holds_the_output(tmp_path, monkeypatch, step, script):
    fake_tool(tmp_path / "bin", "cmake", script)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(OSError, match=f"{step} failed") as e:
        llama_cpp._build(tmp_path / "src", tmp_path, {"GGML_AVX2": "ON"}, 1)
    log = tmp_path / "build.log"
    assert str(log) in str(e.value) and "CMake Error: fake failure" in log.read_text()
    assert "-DGGML_AVX2=ON" in log.read_text()


def test_jobs_zero_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(llama_cpp, "fetch", lambda *a, **k: pytest.fail("a build started"))
    p = argparse.ArgumentParser()
    llama_cpp.add_engine_args(p)
    with pytest.raises(ValueError, match="--jobs 0: give 1 to"):
        llama_cpp.main(p.parse_args(["fetch", "llama.cpp", "--jobs", "0"]))


def test_engine_info_with_an_empty_cache_is_one_line_and_exit_2(tmp_path):
    # a cc that compiles nothing (no probe runs: fast) and a c++ that names itself
    fake_tool(tmp_path / "bin", "cc", "exit 1\n")
    fake_tool(tmp_path / "bin", "c++", 'echo "fake c++ 1.0"\n')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "spectrain", "engine", "info", "llama.cpp"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "spectrain engine fetch llama.cpp" in r.stderr
    assert "Traceback" not in r.stderr


# server -----------------------------------------------------------------------------------------------------

@pytest.fixture
def engine(tmp_path):
    return fake.install(tmp_path / "engine")


def speculating(engine, tmp_path) -> LlamaServer:
    return LlamaServer(engine, tmp_path / "m.gguf", draft=tmp_path / "d.gguf", spec_type="draft-eagle3", k=3,
                       log=tmp_path / "server.log")


def test_complete_returns_tokens_and_each_requests_own_counters(engine, tmp_path):
    with speculating(engine, tmp_path) as s:
        r1 = s.complete([7, 8, 9], n_predict=4, temperature=0.0, seed=0, top2=True)
        r2 = s.complete([20], n_predict=2, temperature=0.0, seed=0)
    assert r1.tokens == [10, 11, 12, 13] and r1.text == "t10 t11 t12 t13" and r1.predicted_n == 4
    assert (r1.drafts, r1.draft_n, r1.draft_n_accepted, r1.accepted_per_pos) == (4, 12, 8, [4, 3, 1])
    assert (r2.drafts, r2.draft_n, r2.draft_n_accepted, r2.accepted_per_pos) == (2, 6, 4, [2, 1, 1])
    assert r1.top2_logprobs == [[(t, -0.25), (t + 1, -2.25)] for t in r1.tokens] and r2.top2_logprobs == []
    assert r1.predicted_per_second == 100.0 and r2.predicted_ms == 20.0


def test_the_server_runs_one_slot_metrics_and_p_min_0_on_localhost(engine, tmp_path):
    with speculating(engine, tmp_path) as s:
        argv = fake.state(engine.root)["argv"]
        assert s.url == f"http://127.0.0.1:{s.port}"
    opt = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("-")}
    assert opt["-np"] == "1" and opt["--spec-draft-p-min"] == "0" and opt["--host"] == "127.0.0.1"
    assert opt["--spec-type"] == "draft-eagle3" and opt["--spec-draft-n-max"] == "3" and "--metrics" in argv
    assert opt["-md"] == str(tmp_path / "d.gguf") and opt["-m"] == str(tmp_path / "m.gguf")


def test_an_http_error_is_a_runtime_error_naming_the_code(engine, tmp_path):
    with speculating(engine, tmp_path) as s, pytest.raises(RuntimeError, match="answered 400"):
        s.complete([], n_predict=2, temperature=0.0, seed=0)


@pytest.mark.parametrize("kw", [{"draft": "d.gguf"}, {"spec_type": "draft-eagle3"}, {"spec_type": "draft", "k": 0}])
def test_a_draft_without_spec_type_or_k_is_refused_before_starting(engine, tmp_path, kw):
    with pytest.raises(ValueError):
        LlamaServer(engine, tmp_path / "m.gguf", **kw)
    assert not (engine.binary(fake.STATE)).exists()


def test_a_server_that_dies_while_starting_names_its_log_and_message(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_DIE", "error: failed to load model 'm.gguf'")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        speculating(engine, tmp_path).__enter__()
    assert "failed to load model 'm.gguf'" in str(e.value) and str(tmp_path / "server.log") in str(e.value)
    assert time.monotonic() - t0 < 30  # found out at once, not after START_TIMEOUT


def test_stop_ends_the_server_and_its_children(engine, tmp_path):
    s = speculating(engine, tmp_path).__enter__()
    st = fake.state(engine.root)
    assert st["pid"] == s.proc.pid and fake.alive(st["child"])
    s.stop()
    deadline = time.monotonic() + 5
    while fake.alive(st["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.proc.poll() is not None and not fake.alive(st["pid"]) and not fake.alive(st["child"])
    s.stop()  # twice is harmless


# regeneration through the engine ------------------------------------------------------------------------------

def test_parallel_slots_split_the_context_and_sleeping_threads_are_asked_for(engine, tmp_path):
    with LlamaServer(engine, tmp_path / "m.gguf", parallel=4, ctx=512, spin=False, log=tmp_path / "s.log"):
        st = fake.state(engine.root)
    opt = {a: b for a, b in zip(st["argv"], st["argv"][1:]) if a.startswith("-")}
    assert opt["-np"] == "4" and opt["-c"] == "2048" and st["omp_wait_policy"] == "passive"
    with LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "s.log"):
        st = fake.state(engine.root)
    opt = {a: b for a, b in zip(st["argv"], st["argv"][1:]) if a.startswith("-")}
    assert opt["-np"] == "1" and opt["-c"] == "4096" and st["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY")
    with pytest.raises(ValueError, match=">= 1 slot"):
        LlamaServer(engine, tmp_path / "m.gguf", parallel=0)


def _regen_recipe(tmp_path, target: str) -> Path:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": "x"}]} for i in range(6)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: {{name_or_path: {target}}}\ndata: {{train_files: [{data}]}}\n")
    return recipe


def test_regenerate_with_engine_starts_answers_through_and_stops_the_server(engine, tmp_path, monkeypatch):
    from spectrain.cli import main as cli_main
    from spectrain.engines import llama_cpp

    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out" / "regen.jsonl"
    rc = cli_main(["regenerate", str(_regen_recipe(tmp_path, str(gguf))), "--out", str(out), "--engine", "llama.cpp",
                   "--parallel", "3", "--threads", "1", "--max-new-tokens", "2", "--temperature", "0,1"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(6)]
    assert all(r["messages"][1]["content"] == "echo: question" for r in rows)  # cut at 2 words: max_new_tokens
    assert {r["temperature"] for r in rows} <= {0.0, 1.0}
    st = fake.state(engine.root)
    opt = {a: b for a, b in zip(st["argv"], st["argv"][1:]) if a.startswith("-")}
    assert opt["-np"] == "3" and opt["-t"] == "1" and opt["-m"] == str(gguf.resolve())
    assert st["omp_wait_policy"] == "passive" and not fake.alive(st["pid"]) and not fake.alive(st["child"])


def test_regenerate_with_engine_refuses_a_target_that_is_not_gguf_and_server_with_engine(engine, tmp_path, capsys,
                                                                                        monkeypatch):
    from spectrain.cli import main as cli_main
    from spectrain.engines import llama_cpp

    monkeypatch.setattr(llama_cpp, "require", lambda: engine)
    recipe = _regen_recipe(tmp_path, str(tmp_path))  # a directory: an HF checkpoint, not a GGUF file
    out = str(tmp_path / "o.jsonl")
    assert cli_main(["regenerate", str(recipe), "--out", out, "--engine", "llama.cpp"]) == 2
    assert "serves a local .gguf target" in capsys.readouterr().err
    assert cli_main(["regenerate", str(recipe), "--out", out, "--engine", "llama.cpp", "--server", "http://x"]) == 2
    assert "give one" in capsys.readouterr().err
    assert not (engine.binary(fake.STATE)).exists()  # nothing was started


def test_a_sigterm_to_the_caller_stops_the_server_and_restores_the_handler(engine, tmp_path):
    """A scheduler's or `timeout`'s SIGTERM ends the caller through SystemExit inside the `with`, so the server (its
    own session, out of reach of the caller's group) is stopped instead of serving forever."""
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import fake_llama_server as fake\nfrom spectrain.engines.server import LlamaServer\n"
            f"e = fake.install(__import__('pathlib').Path({str(tmp_path / 'e')!r}))\n"
            f"with LlamaServer(e, 'm.gguf', log={str(tmp_path / 's.log')!r}):\n"
            "    print('up', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    st = fake.state(tmp_path / "e")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    assert not fake.alive(st["pid"]) and not fake.alive(st["child"])
    before = signal.getsignal(signal.SIGTERM)
    with LlamaServer(engine, tmp_path / "m.gguf", log=tmp_path / "t.log"):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
