"""One `llama-server` on 127.0.0.1: started, asked, measured, stopped by its own process id.

    with LlamaServer(engine, "SmolLM2.Q4_1.gguf", draft="head.gguf", spec_type="draft-eagle3", k=3) as s:
        r = s.complete(prompt_ids, n_predict=64, temperature=0.0, seed=0)
        r.tokens, r.draft_n, r.accepted_per_pos, r.predicted_per_second

One slot (``-np 1``: the server's default is 4, which splits the context and batches requests), threads
stated, p_min 0 (every step drafts k tokens, so per-position counts are conditional acceptance as spectrain
defines it), ``--metrics`` on: the per-position accepted counters are cumulative over the server's life,
so each request's counts are the difference of ``/metrics`` read before and after it (one slot, requests in
sequence: nothing else moves them). The server runs in its own session and is stopped through its process
group, so no worker survives a crash of the caller.

The server spectrain talks to is the one it started. The port is probed free and then handed to llama-server, so
another process can take it in between; the answer to /health is therefore trusted only once the process listening
on the port is ours (Linux: the listening socket is one of our server's file descriptors; elsewhere /props names our
model) and our process is alive. A server that exits while starting or during the run fails the run at once, naming
its exit status and the log's last lines: every request checks the process before and after it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from spectrain.engines.llama_cpp import Engine
from spectrain.engines.process import install_sigterm_exit, stop_group

START_TIMEOUT = 180.0  # seconds for a server to load its models and answer /health
_METRIC = re.compile(r'^llamacpp:(spec_decode_[a-z_]+)(?:\{position="(\d+)"\})?\s+([0-9.eE+-]+)$')
# common/speculative.cpp common_speculative_print_stats (trace level, printed when a task ends): cumulative
# calls and milliseconds of the draft's begin / generate / accept phases over the server's life
_DRAFT_STATS = re.compile(r"statistics\s+\S+: #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+).*"
                          r"dur\(b,g,a\) = ([0-9.]+), ([0-9.]+), ([0-9.]+) ms")


class ServerError(OSError, RuntimeError):
    """The llama-server spectrain started is gone or is not the one answering: the run stops at once (one line,
    exit status 2)."""


# llama-server's sampler defaults (common/common.h: top-k 40, top-p 0.95, min-p 0.05, ...) truncate the target's
# distribution: a request that names only the temperature is sampled from that truncation, not from p. Every
# request spectrain sends names every sampler, so T = 1 means the target's own distribution.
NEUTRAL_SAMPLERS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0}


def sampling_settings(temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict:
    """The request fields that make llama-server sample from the target's distribution at `temperature`, warped only
    by the given top-k / top-p (0 / 1 = off), as spectrain's own sampler does (and nothing else)."""
    return {**NEUTRAL_SAMPLERS, "temperature": temperature, "top_k": top_k, "top_p": top_p}


@dataclass
class Completion:
    tokens: list[int]
    text: str
    predicted_n: int
    predicted_per_second: float
    predicted_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    drafts: int = 0  # verification steps
    accepted_per_pos: list[int] = field(default_factory=list)  # steps whose position i was accepted
    top2_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per generated token
    draft_ms: float = 0.0  # the drafter's own time in this request (generate + accept phases)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: Engine, model: Path, port: int, threads: int, ctx: int, draft: Path | None = None,
                   spec_type: str | None = None, k: int | None = None, parallel: int = 1) -> list[str]:
    """`ctx` is per slot: the server splits -c over its -np slots."""
    cmd = [str(engine.binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(parallel), "-t", str(threads), "-tb", str(threads), "-c", str(ctx * parallel), "--metrics",
           "--no-webui"]
    if spec_type:
        cmd += ["--spec-type", spec_type, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0", "-lv", "4"]  # trace level: the draft's own timings (draft_ms)
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
    return cmd


_LOCAL = {"0100007F", "7F000001", "00000000", "0" * 32, "0000000000000000FFFF00000100007F", "0000000000000000FFFF000000000000"}


def port_listeners(port: int) -> set[int] | None:
    """Socket inodes listening on `port` at an address that 127.0.0.1 reaches (127.0.0.1, 0.0.0.0, ::, their v4-mapped
    forms), from /proc/net/tcp{,6}; None where /proc does not tell (not Linux)."""
    found, seen = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for line in lines:
            f = line.split()
            addr, _, hexport = f[1].partition(":")
            if f[3] == "0A" and int(hexport, 16) == port and addr.upper() in _LOCAL:  # 0A: LISTEN
                found.add(int(f[9]))
    return found if seen else None


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            out.add(int(m.group(1)))
    return out


class LlamaServer:
    """A llama-server process: a context manager that starts it, waits for /health and stops it."""

    def __init__(self, engine: Engine, model: str | Path, *, draft: str | Path | None = None,
                 spec_type: str | None = None, k: int | None = None, threads: int = 2, ctx: int = 4096,
                 log: str | Path | None = None, timeout: float = 600.0, parallel: int = 1, spin: bool = True):
        """`parallel` slots of `ctx` tokens each (several requests batched: throughput, not timing). `spin`: the
        OpenMP threads busy-wait between kernels (the OpenMP default; False sets OMP_WAIT_POLICY=passive).
        Measured on 2 cores, 16 streams: 131 tok/s spinning on an idle machine but 24 tok/s beside one other busy
        process; 89 / 74 tok/s sleeping."""
        if draft is not None and spec_type is None:
            raise ValueError("a draft model needs a --spec-type (llama-server loads a draft it is not told to use "
                             "and does not speculate)")
        if spec_type is not None and (k is None or k < 1):
            raise ValueError(f"speculation needs k >= 1, got {k}")
        if parallel < 1 or threads < 1:
            raise ValueError(f"llama-server needs >= 1 slot and >= 1 thread, got {parallel} and {threads}")
        self.port = free_port()
        self.cmd = server_command(engine, Path(model), self.port, threads, ctx,
                                  Path(draft) if draft is not None else None, spec_type, k, parallel)
        self.env = None if spin else {**os.environ, "OMP_WAIT_POLICY": "passive"}
        self.log = Path(log) if log else Path(os.devnull)
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self._on_term = None  # the SIGTERM handler to restore on exit
        self.model = Path(model)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        # A SIGTERM would end Python without running __exit__ and leave the server (its own session) serving forever
        self._on_term = install_sigterm_exit()
        try:
            return self._start()
        except BaseException:
            self.__exit__()
            raise

    def _start(self) -> LlamaServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            self.check_alive("while starting")
            try:
                ok = self._get("/health", timeout=2.0).get("status") == "ok"
            except (OSError, ValueError):
                ok = False
            if ok:
                self._check_identity()
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"llama-server did not answer /health within {START_TIMEOUT:.0f} s (log {self.log})")

    def gone(self, when: str = "during the run") -> str | None:
        """Why the server cannot be answering (it exited), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        held = port_listeners(self.port)
        hint = f"; port {self.port} is held by another process" if held else ""
        return (f"llama-server (pid {self.proc.pid}) exited with {self.proc.returncode} {when}: {self._tail()}"
                f"{hint} (log {self.log})")

    def check_alive(self, when: str = "during the run") -> None:
        why = self.gone(when)
        if why:
            raise ServerError(why)

    def _check_identity(self) -> None:
        """The /health that answered came from our process, not from one that took the port first."""
        self.check_alive("while starting")
        held = port_listeners(self.port)
        if held:  # Linux says who listens
            if held <= socket_inodes(self.proc.pid):
                return
            self.stop()
            raise ServerError(f"127.0.0.1:{self.port} answered, but not from the llama-server spectrain started (pid "
                              f"{self.proc.pid}): another process holds the port (it took it between spectrain's "
                              "probe and the server's start); nothing was sent to it: rerun (a new port is picked)")
        try:  # /proc does not say: the server's own account of itself must name our model
            path = self._get("/props", timeout=5.0).get("model_path")
        except (OSError, ValueError, AttributeError):
            path = None
        if path is not None and Path(path) != self.model:
            self.stop()
            raise ServerError(f"127.0.0.1:{self.port} serves {path}, not {self.model}: another server holds the port; "
                              "rerun (a new port is picked)")

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._on_term is not None:
            signal.signal(signal.SIGTERM, self._on_term)
            self._on_term = None

    def stop(self) -> None:
        """Its whole process group: SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None:
            stop_group(self.proc)

    def _tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return " | ".join(lines[-3:])[-400:]

    def _get(self, path: str, timeout: float | None = None):
        with urllib.request.urlopen(self.url + path, timeout=timeout or self.timeout) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def _ask(self, what: str, fn):
        """`fn()` against the server, which must be alive before and after it; a failed request of a dead server
        says it died (not a connection error to retry)."""
        self.check_alive()
        try:
            out = fn()
        except urllib.error.HTTPError:
            raise
        except (OSError, ValueError) as e:
            self.check_alive()
            raise ServerError(f"llama-server at {self.url} did not answer {what}: {type(e).__name__}: {e} "
                              f"(log {self.log})") from e
        self.check_alive()
        return out

    def spec_counters(self) -> dict:
        """The cumulative speculative counters of /metrics: drafts, drafted, accepted, accepted per position."""
        out: dict = {"per_pos": {}}
        for line in self._ask("/metrics", lambda: self._get("/metrics")).splitlines():
            m = _METRIC.match(line.strip())
            if not m:
                continue
            name, pos, value = m.group(1), m.group(2), float(m.group(3))
            if pos is not None:
                out["per_pos"][int(pos)] = int(value)
            else:
                out[name] = int(value)
        return out

    def complete(self, prompt: list[int], n_predict: int, temperature: float, seed: int,
                 top2: bool = False, top_k: int = 0, top_p: float = 1.0) -> Completion:
        """One /completion over token ids (the chat template is applied by the caller, as spectrain eval does)."""
        before, (n_before, ms_before) = self.spec_counters(), self._draft_stats()
        body = {"prompt": prompt, "n_predict": n_predict, "seed": seed, **sampling_settings(temperature, top_k, top_p),
                "ignore_eos": False, "cache_prompt": False, "return_tokens": True, "stream": False,
                "n_probs": 2 if top2 else 0, "post_sampling_probs": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})

        def post():
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())

        try:
            res = self._ask("/completion", post)
        except urllib.error.HTTPError as e:
            raise ServerError(f"llama-server answered {e.code}: {e.read()[:300]!r} (log {self.log})") from e
        out = _completion(res, before, self.spec_counters(), top2)
        if out.draft_n:  # the task's statistics line is logged by another thread: wait for it (<= 2 s)
            deadline, (n, ms) = time.monotonic() + 2.0, self._draft_stats()
            while n == n_before and time.monotonic() < deadline:
                time.sleep(0.02)
                n, ms = self._draft_stats()
            out.draft_ms = ms - ms_before
        return out

    def _draft_stats(self) -> tuple[int, float]:
        """(requests the drafter began, cumulative ms it spent generating and accepting drafts), from the last
        statistics line in the log's tail (the counts are cumulative, so the tail suffices)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, 2) - (1 << 20)))
                text = f.read().decode(errors="replace")
        except OSError:
            return 0, 0.0
        found = _DRAFT_STATS.findall(text)
        return (int(found[-1][0]), float(found[-1][4]) + float(found[-1][5])) if found else (0, 0.0)


def _completion(res: dict, before: dict, after: dict, top2: bool) -> Completion:
    t = res.get("timings", {})
    per_pos = [after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0) for i in sorted(after["per_pos"])]
    probs = []
    if top2:
        for step in res.get("completion_probabilities", []):
            probs.append([(int(c["id"]), float(c["logprob"])) for c in step.get("top_logprobs", [])[:2]])
    return Completion(
        tokens=[int(x) for x in res.get("tokens", [])], text=res.get("content", ""),
        predicted_n=int(t.get("predicted_n", 0)), predicted_per_second=float(t.get("predicted_per_second", 0.0)),
        predicted_ms=float(t.get("predicted_ms", 0.0)), draft_n=int(t.get("draft_n", 0)),
        draft_n_accepted=int(t.get("draft_n_accepted", 0)),
        drafts=after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0),
        accepted_per_pos=per_pos, top2_logprobs=probs)
