"""`spectrain regenerate --server URL[,URL...]`: the target's answers from an OpenAI-compatible server.

    vllm serve meta-llama/Llama-3.1-8B-Instruct --data-parallel-size 8 &        # or sglang.launch_server
    spectrain regenerate eagle3 --server http://127.0.0.1:8000 --concurrency 256 --out data/regen/x.jsonl

The same rows, turn order, skip rules, resume and accounting as the in-process path (spectrain/data/regenerate.py);
only who decodes differs. Stdlib only (urllib + a thread pool): one request per assistant turn, rows answered
`--concurrency` at a time, spread round-robin over the URLs (e.g. one vLLM per GPU).

- A URL is a server root (``http://host:8000``), its ``/v1`` or the full ``/v1/chat/completions``.
- Transient failures (connection errors, timeouts, HTTP 408 / 429 / 5xx) are retried ``--retries`` times with
  exponential backoff; a row that still fails is *failed*: it is not written, the final file is not made, and
  rerunning the command retries exactly those rows. A request the server rejects (other 4xx, e.g. a prompt
  over its context length) is permanent: the row is skipped at its first turn or shortened at a later one,
  like an over-long prompt in-process. After ``concurrency + 16`` failed rows in a row the run stops early.
- Nothing the server sends is trusted (ChatClient): no redirect is followed and the API key goes only to the
  given URLs; one deadline (``--timeout``) bounds a whole request; the body read is bounded by max_tokens; an
  answer that does not fit its request (too long, usage counts over max_tokens / negative / not integers)
  fails the row, naming the field. A setup error (HTTP 401 / 403 / 404, a redirect, an answer from another
  model) stops the run at once with its fix. ``Retry-After`` on 429 / 503 is honoured, up to 60 s.
- Rows are written to FILE.tmp in input order (a finished row waits for the rows before it), so a killed
  client loses only the rows in flight.
- ``data.chat_template_kwargs`` / ``--chat-template-kwargs`` go into every request as
  ``chat_template_kwargs`` (vLLM and SGLang pass them to the template, e.g. ``{"enable_thinking": false}``).
- ``--reasoning keep`` (default) writes what the target wrote: a server's separate ``reasoning_content``
  (vLLM / SGLang with a reasoning parser) is put back in front of the answer as ``<think>\\n...\\n</think>\\n\\n``;
  ``--reasoning strip`` drops reasoning (``reasoning_content`` and ``<think>...</think>`` blocks, and an
  unclosed block cut by max_new_tokens), leaving the answer only.
- Sampling (T > 0) sends the row's seed (seed, id, turn) as the request's ``seed``; a server that honours it
  (vLLM does) gives the same answer on a rerun. ``ServerConfig.samplers`` go into every request, and each row
  records its sampler (``"sampler"``; None = not sent: the server's default; regenerate.py says why).
"""

from __future__ import annotations

import email.utils
import hashlib
import http.client
import itertools
import json
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from spectrain.io.outputs import open_nofollow
from spectrain.io.progress import Progress

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)
REASONING_MODES = ("keep", "strip")
BACKOFF_S = 1.0  # first retry after 1 s, then 2, 4 ... capped at 30 s
RETRY_AFTER_MAX_S = 60.0  # a 429 / 503's Retry-After is honoured up to this (a hostile value cannot park the run)
MAX_BYTES_PER_TOKEN = 256  # no vocabulary's token decodes to more: an answer beyond max_tokens * this is not one
_BODY_SLACK = 64 * 1024  # JSON framing, ids, usage and error text around the answer
_sleep = threading.Event.wait  # (stop event, seconds): a stopped client waits no more; tests record the waits
_FSYNC_EVERY_S = 2.0
SAMPLER_KEYS = ("top_k", "top_p", "min_p")  # recorded per row beside the temperature (None: not sent)


class ServerConfigError(ValueError):
    """The server refuses every request for a reason of the setup (API key, model name, URL, a redirect): the
    run stops at once with the fix (a ValueError: the CLI prints one line, exit status 2)."""


class BadResponse(ValueError):
    """An answer that does not fit its request (too long for max_tokens, bad usage counts, not a completion)."""


class ServerRejected(Exception):
    """The server refused the request (a 4xx other than 408/429): retrying cannot help."""


class ServerUnavailable(Exception):
    """No answer after every retry (connection refused, timeouts, 5xx ...)."""


@dataclass
class ServerConfig:
    urls: list[str]
    model: str
    concurrency: int = 64
    retries: int = 5
    timeout_s: float = 600.0
    gone: Callable[[], str | None] | None = None  # a server spectrain started: why it is gone (None: it runs)
    samplers: dict = field(default_factory=dict)  # sampler fields sent with every request (beside the temperature)

    def validate(self) -> ServerConfig:
        if not self.urls:
            raise ValueError("--server: give at least one URL, e.g. --server http://127.0.0.1:8000")
        self.urls = [endpoint(u) for u in self.urls]
        for bad, msg in ((self.concurrency < 1, f"--concurrency {self.concurrency}: must be >= 1"),
                         (self.retries < 0, f"--retries {self.retries}: must be >= 0"),
                         (not 0 < self.timeout_s < math.inf, f"--timeout {self.timeout_s}: give seconds > 0, "
                          "e.g. 600 (one deadline for a whole request)")):
            if bad:
                raise ValueError(msg)
        return self


# ---- shared with local regeneration (regenerate.py): the per-row seed and the resume scan ----
def _row_seed(seed: int, row_id: str, turn: int) -> int:
    return int(hashlib.sha1(f"{seed}:{row_id}:{turn}".encode()).hexdigest()[:15], 16)


def _read_done(tmp: Path) -> Counter:
    """Ids already in `tmp` (a multiset: input ids may repeat); a torn last line is cut off."""
    done: Counter = Counter()
    if not tmp.exists():
        return done
    good = 0
    with open(tmp, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):  # every row is written with its newline in one call: torn
                    raise ValueError
                done[json.loads(line)["id"]] += 1
                good += len(line)
            except (ValueError, KeyError, TypeError):  # JSON / UTF-8 errors are ValueErrors too
                if f.read():  # damage before the end is not an interruption
                    raise ValueError(f"{tmp} is corrupt (bad line after {sum(done.values())} rows); delete it "
                                     "to start over") from None
                break
    with open_nofollow(tmp, "r+b") as f:
        f.truncate(good)  # drop the interrupted write, if any
    return done


def endpoint(url: str) -> str:
    """The chat-completions URL of a server root, a /v1 URL or the endpoint itself."""
    u = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/]+", u):
        raise ValueError(f"--server {url!r}: give an http(s) URL such as http://127.0.0.1:8000")
    if u.endswith("/chat/completions"):
        return u
    return u + ("/chat/completions" if u.endswith("/v1") else "/v1/chat/completions")


class ChatClient:
    """POSTs chat-completion requests round-robin over the URLs, with retries and backoff. Thread-safe.

    It trusts nothing it is sent: no redirect is followed (the request and the API key go only to the
    configured hosts), a whole request has one deadline (--timeout; a server trickling bytes cannot hang
    it), the body read is bounded by what max_tokens can produce and every answer is checked against its
    request (check_response). A setup error (401 / 403 / 404 / a redirect / another model) stops every
    thread at once."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg.validate()
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._fatal: ServerConfigError | None = None
        self._stopped = threading.Event()  # set by stop(): requests still retrying give up at once
        self.models: Counter = Counter()  # the model names the server answered as (printed at the end)
        key = os.environ.get("OPENAI_API_KEY", "")  # servers started with --api-key want it
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def stop(self) -> None:
        """No more attempts: after Ctrl-C or a finished run, threads still retrying a stopped server (up to
        --retries backoffs, tens of seconds) would hold the process open in silence."""
        self._stopped.set()

    def _check_gone(self) -> None:
        """A dead server fails every remaining request: stop now, not after --retries backoffs per row."""
        if self.cfg.gone is not None and (why := self.cfg.gone()):
            self._fatal = ServerConfigError(f"{why}; the rows written so far are kept: rerun the same command to resume")
            raise self._fatal

    def _url(self) -> str:
        with self._lock:
            return self.cfg.urls[next(self._turn) % len(self.cfg.urls)]

    def _post(self, url: str, body: dict) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one POST under one deadline; http.client follows no redirect."""
        u = urllib.parse.urlsplit(url)
        conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection)(
            u.hostname, u.port, timeout=self.cfg.timeout_s)
        cut, timer, deadline = threading.Event(), None, time.monotonic() + self.cfg.timeout_s
        limit = body_limit(body["max_tokens"])
        try:
            conn.connect()  # bounded by the socket timeout; from here on one timer bounds the whole exchange,
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, (conn.sock, cut))  # as
            timer.start()  # per-read timeouts never end a trickle of bytes
            conn.request("POST", u.path + (f"?{u.query}" if u.query else ""), json.dumps(body).encode(),
                         self._headers)
            resp = conn.getresponse()
            data = resp.read(limit + 1)
            headers = {k.lower(): v for k, v in resp.getheaders()}
        except (OSError, http.client.HTTPException):
            if cut.is_set():
                raise TimeoutError(f"no complete answer within --timeout {self.cfg.timeout_s:g}s") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            conn.close()
        if cut.is_set():
            raise TimeoutError(f"no complete answer within --timeout {self.cfg.timeout_s:g}s")
        if len(data) > limit:
            raise BadResponse(f"the response is over {limit} bytes, more than max_tokens {body['max_tokens']} "
                              "can produce")
        return resp.status, headers, data

    def _refuse(self, url: str, status: int, headers: dict, data: bytes) -> None:
        """Raise for a status retrying cannot fix: a setup error stops the run, another 4xx skips the row."""
        detail = _printable(data[:400].decode("utf-8", "replace"))[:160]
        if 300 <= status < 400:
            raise ServerConfigError(f"{url} answered HTTP {status}, a redirect to "
                                    f"{_printable(headers.get('location', '(none)'))[:200]!r}: spectrain follows "
                                    "no redirect (it would send the request and API key elsewhere); give the "
                                    "final URL with --server")
        if status in (401, 403):
            have = "is set but refused" if "Authorization" in self._headers else "is not set"
            raise ServerConfigError(f"{url} answered HTTP {status} ({detail}): the server wants an API key and "
                                    f"OPENAI_API_KEY {have}; set it to the key the server was started with "
                                    "(--api-key) and rerun")
        if status == 404:
            models = url.replace("/chat/completions", "/models")
            raise ServerConfigError(f"{url} answered HTTP 404 ({detail}): the server has no model "
                                    f"{self.cfg.model!r} (or no such endpoint); pass --server-model with a name "
                                    f"listed at {models}, or check the --server URL")
        if status not in (408, 429) and status < 500:
            raise ServerRejected(f"HTTP {status}: {detail[:120]}")

    def complete(self, body: dict) -> dict:
        """The server's answer to `body`, checked against it; transient failures are retried with backoff (at
        least the server's Retry-After, up to RETRY_AFTER_MAX_S)."""
        last, wait = "", 0.0
        for attempt in range(self.cfg.retries + 1):
            if self._fatal is not None:  # another row met a setup error: every request would meet it
                raise self._fatal
            self._check_gone()
            if wait:
                _sleep(self._stopped, wait)
            if self._stopped.is_set():
                raise ServerUnavailable(f"{last or 'no request sent'} (the client stopped)")
            url = self._url()
            wait = min(30.0, BACKOFF_S * 2 ** attempt)
            try:
                status, headers, data = self._post(url, body)
                if 200 <= status < 300:
                    resp = json.loads(data)
                    check_response(resp, body, url)
                    with self._lock:
                        self.models[resp.get("model") or "(not named)"] += 1
                    return resp
                self._refuse(url, status, headers, data)
                wait = max(wait, retry_after(headers.get("retry-after")))
                last = f"{url}: HTTP {status}"
            except ServerConfigError as e:
                self._fatal = e
                raise
            except (http.client.HTTPException, OSError, ValueError) as e:  # ValueError: not JSON / BadResponse
                self._check_gone()
                last = f"{url}: {type(e).__name__}: {e}"
        raise ServerUnavailable(f"{last} (after {self.cfg.retries + 1} attempts)")


def _cut(sock: socket.socket, cut: threading.Event) -> None:
    """The deadline: shutting the socket down wakes a read blocked in another thread. (The socket itself, not
    conn.sock: http.client hands it to the response and forgets it when the server will close.)"""
    cut.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _printable(text: str) -> str:
    """A server's text on one line, without control characters (it goes into an error message)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def retry_after(value: str | None) -> float:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), bounded by RETRY_AFTER_MAX_S."""
    if not value:
        return 0.0
    try:
        secs = float(value)
    except ValueError:
        try:
            secs = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return 0.0
    return min(RETRY_AFTER_MAX_S, secs) if math.isfinite(secs) and secs > 0 else 0.0


def body_limit(max_tokens: int) -> int:
    """The most bytes a response to max_tokens can hold: every token at MAX_BYTES_PER_TOKEN, JSON-escaped
    (\\u00XX: 6 bytes per byte), plus framing."""
    return _BODY_SLACK + 6 * MAX_BYTES_PER_TOKEN * max_tokens


def _same_model(got: str, want: str) -> bool:
    """vLLM / SGLang answer with the requested name; OpenAI-style APIs add a snapshot suffix (gpt-x-2024-...)."""
    return got == want or got.startswith(want + "-")


def check_response(resp, body: dict, url: str) -> None:
    """Refuse an answer that does not fit its request, naming the field (BadResponse: the row is retried and,
    failing, not written); an answer from another model is a setup error (ServerConfigError)."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    msg = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else None
    if not isinstance(msg, dict):
        raise BadResponse(f"not a chat-completion response (no choices[0].message): {_printable(str(resp))[:120]}")
    texts = [msg.get(k) for k in ("content", "reasoning_content", "reasoning")]
    for k, v in zip(("content", "reasoning_content", "reasoning"), texts):
        if v is not None and not isinstance(v, str):
            raise BadResponse(f"choices[0].message.{k} is a {type(v).__name__}, not text")
    size, cap = sum(len(v.encode("utf-8", "replace")) for v in texts if v), MAX_BYTES_PER_TOKEN * body["max_tokens"]
    if size > cap:
        raise BadResponse(f"the answer is {size} bytes, more than max_tokens {body['max_tokens']} can produce "
                          f"(at most {cap})")
    usage = resp.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise BadResponse(f"usage is a {type(usage).__name__}, not an object")
    for k, v in (usage or {}).items():
        if k.endswith("_tokens") and v is not None and (type(v) is not int or v < 0):
            raise BadResponse(f"usage.{k} = {_printable(repr(v))[:40]} is not a non-negative integer")
    done = (usage or {}).get("completion_tokens") or 0
    if done > body["max_tokens"]:
        raise BadResponse(f"usage.completion_tokens = {done} exceeds the request's max_tokens {body['max_tokens']}")
    model = resp.get("model")
    if model is not None and not isinstance(model, str):
        raise BadResponse(f"model is a {type(model).__name__}, not a name")
    if model and not _same_model(model, body["model"]):
        raise ServerConfigError(f"{url} answered as model {_printable(model)[:100]!r}, not the requested "
                                f"{body['model']!r}: that server serves another model; point --server at the "
                                f"target's server, or pass --server-model {_printable(model)[:100]} if it is the "
                                "target")


def apply_reasoning(content: str, reasoning: str, mode: str) -> str:
    """The answer text to keep, per --reasoning (see the module doc)."""
    if mode == "strip":
        text = THINK_RE.sub("", content)
        return text[:text.index("<think>")] if "<think>" in text else text  # a block cut by max_new_tokens
    if reasoning.strip():
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    return content


def row_record(row_id: str, conv: list[dict], regen, sampler: dict | None = None) -> dict:
    """A regenerated row, its sampler (default: spectrain's own, p at T untruncated) and, under a mix, its T."""
    t, mix = regen.row_temperature(row_id), isinstance(regen.temperature, list)
    return {"id": row_id, "messages": conv, **({"temperature": t} if mix else {}),
            "sampler": sampler or {"temperature": t, "top_k": 0, "top_p": 1.0, "min_p": 0.0}}


def answer_row(client: ChatClient, row: dict, regen, body_extra: dict) -> tuple[dict, Counter]:
    """Answer every assistant turn of one row in order -> (the row or a skip marker, counts).
    Raises ServerUnavailable when a turn gets no answer at all (the row is then retried on a rerun)."""
    counts: Counter = Counter()
    msgs, conv, start = row["messages"], [], 0
    for turn, idx in enumerate(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"):
        conv += [dict(m) for m in msgs[start:idx]]
        start = idx + 1
        temperature = regen.row_temperature(row["id"])
        body = {"model": client.cfg.model, "messages": conv, "max_tokens": regen.max_new_tokens,
                **client.cfg.samplers, "temperature": temperature, **body_extra}
        if temperature > 0:
            body["seed"] = _row_seed(regen.seed, row["id"], turn) % 2**31
        try:
            text, truncated, tokens = _parse(client.complete(body), regen.reasoning)
        except ServerRejected as e:
            text, truncated, tokens, why = "", False, 0, f"server rejected the request: {e}"
        else:
            why = "" if text.strip() else "empty answer"
        counts["tokens"] += tokens
        if why:
            if turn == 0:
                return {"id": row["id"], "_skipped": f"first turn: {why}"}, counts
            while conv[-1]["role"] != "assistant":
                conv.pop()
            counts["shortened"] += 1
            break
        counts["answers"] += 1
        counts["truncated"] += int(truncated)
        conv.append({"role": "assistant", "content": text})
    sent = {"temperature": regen.row_temperature(row["id"]), **{k: client.cfg.samplers.get(k) for k in SAMPLER_KEYS}}
    return row_record(row["id"], conv, regen, sent), counts


def _parse(resp: dict, mode: str) -> tuple[str, bool, int]:
    """(text, truncated, tokens) of a response check_response accepted."""
    choice = resp["choices"][0]
    msg = choice["message"]
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    text = apply_reasoning(msg.get("content") or "", reasoning, mode)
    tokens = (resp.get("usage") or {}).get("completion_tokens") or 0
    return text, choice.get("finish_reason") == "length", tokens


def write_part_server(client: ChatClient, rows: list[dict], tmp: Path, regen, stats) -> None:
    """Answer the rows not yet in `tmp` through the server, appending them in input order."""
    done = _read_done(tmp)
    stats.resumed = sum(done.values())
    if stats.resumed:
        print(f"regenerate: resuming {tmp}: {stats.resumed} rows already done", flush=True)
    todo = []
    for r in rows:  # consume the multiset in input order so that repeated ids resume correctly
        if done[r["id"]] > 0:
            done[r["id"]] -= 1
        else:
            todo.append(r)
    extra = {"chat_template_kwargs": dict(regen.chat_template_kwargs)} if regen.chat_template_kwargs else {}
    window, give_up = 2 * client.cfg.concurrency, client.cfg.concurrency + 16
    pending: deque[Future] = deque()
    it, streak, t0, synced = iter(todo), 0, time.perf_counter(), time.monotonic()
    bar = Progress(len(rows), "row", "regenerate", initial=stats.resumed)
    pool = ThreadPoolExecutor(client.cfg.concurrency, thread_name_prefix="regen")
    try:
        with bar.bar, open_nofollow(tmp, "a") as f:
            pending.extend(pool.submit(answer_row, client, r, regen, extra) for r in itertools.islice(it, window))
            while pending:
                fut = pending.popleft()
                pending.extend(pool.submit(answer_row, client, r, regen, extra) for r in itertools.islice(it, 1))
                try:
                    out, counts = fut.result()
                except ServerUnavailable as e:
                    stats.failed, streak, stats.last_error = stats.failed + 1, streak + 1, str(e)
                    if streak >= give_up:
                        stats.failed += len(pending) + sum(1 for _ in it)  # not attempted: retried on a rerun
                        pending.clear()
                        print(f"regenerate: stopping: {streak} rows in a row got no answer ({e})", flush=True)
                    continue
                streak = 0
                for k, v in counts.items():
                    setattr(stats, k, getattr(stats, k) + v)
                f.write(json.dumps(out, ensure_ascii=False) + "\n")
                f.flush()  # a killed client keeps every finished row (the OS has it)
                if time.monotonic() - synced > _FSYNC_EVERY_S:
                    os.fsync(f.fileno())
                    synced = time.monotonic()
                bar.advance(1)
                bar.note(f"{stats.tokens} tokens generated")
            os.fsync(f.fileno())
    finally:
        client.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        stats.gen_time_s += time.perf_counter() - t0
