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
- Rows are written to FILE.tmp in input order (a finished row waits for the rows before it), so a killed
  client loses only the rows in flight.
- ``data.chat_template_kwargs`` / ``--chat-template-kwargs`` go into every request as
  ``chat_template_kwargs`` (vLLM and SGLang pass them to the template, e.g. ``{"enable_thinking": false}``).
- ``--reasoning keep`` (default) writes what the target wrote: a server's separate ``reasoning_content``
  (vLLM / SGLang with a reasoning parser) is put back in front of the answer as ``<think>\\n...\\n</think>\\n\\n``;
  ``--reasoning strip`` drops reasoning (``reasoning_content`` and ``<think>...</think>`` blocks, and an
  unclosed block cut by max_new_tokens), leaving the answer only.
- Sampling (T > 0) sends the row's seed (seed, id, turn) as the request's ``seed``; a server that honours it
  (vLLM does) gives the same answer on a rerun.
"""

from __future__ import annotations

import hashlib
import http.client
import itertools
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from spectrain.io.progress import Progress

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)
REASONING_MODES = ("keep", "strip")
BACKOFF_S = 1.0  # first retry after 1 s, then 2, 4 ... capped at 30 s
_FSYNC_EVERY_S = 2.0


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

    def validate(self) -> ServerConfig:
        if not self.urls:
            raise ValueError("--server: give at least one URL, e.g. --server http://127.0.0.1:8000")
        self.urls = [endpoint(u) for u in self.urls]
        for bad, msg in ((self.concurrency < 1, f"--concurrency {self.concurrency}: must be >= 1"),
                         (self.retries < 0, f"--retries {self.retries}: must be >= 0"),
                         (self.timeout_s <= 0, f"--timeout {self.timeout_s}: must be > 0")):
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
    with open(tmp, "r+b") as f:
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
    """POSTs chat-completion requests round-robin over the URLs, with retries and backoff. Thread-safe."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg.validate()
        self._turn = itertools.count()
        self._lock = threading.Lock()
        key = os.environ.get("OPENAI_API_KEY", "")  # servers started with --api-key want it
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def _url(self) -> str:
        with self._lock:
            return self.cfg.urls[next(self._turn) % len(self.cfg.urls)]

    def _post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=self._headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
            return json.loads(resp.read())

    def complete(self, body: dict) -> dict:
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(min(30.0, BACKOFF_S * 2 ** (attempt - 1)))
            url = self._url()
            try:
                return self._post(url, body)
            except urllib.error.HTTPError as e:
                detail = e.read()[:200].decode("utf-8", "replace")
                if e.code not in (408, 429) and e.code < 500:
                    raise ServerRejected(f"HTTP {e.code}: {' '.join(detail.split())[:120]}") from None
                last = f"{url}: HTTP {e.code}"
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                last = f"{url}: {type(e).__name__}: {getattr(e, 'reason', e)}"  # ValueError: a body that is not JSON
        raise ServerUnavailable(f"{last} (after {self.cfg.retries + 1} attempts)")


def apply_reasoning(content: str, reasoning: str, mode: str) -> str:
    """The answer text to keep, per --reasoning (see the module doc)."""
    if mode == "strip":
        text = THINK_RE.sub("", content)
        return text[:text.index("<think>")] if "<think>" in text else text  # a block cut by max_new_tokens
    if reasoning.strip():
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    return content


def answer_row(client: ChatClient, row: dict, regen, body_extra: dict) -> tuple[dict, Counter]:
    """Answer every assistant turn of one row in order -> (the row or a skip marker, counts).
    Raises ServerUnavailable when a turn gets no answer at all (the row is then retried on a rerun)."""
    counts: Counter = Counter()
    msgs, conv, start = row["messages"], [], 0
    for turn, idx in enumerate(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"):
        conv += [dict(m) for m in msgs[start:idx]]
        start = idx + 1
        body = {"model": client.cfg.model, "messages": conv, "max_tokens": regen.max_new_tokens,
                "temperature": regen.temperature, **body_extra}
        if regen.temperature > 0:
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
    return {"id": row["id"], "messages": conv}, counts


def _parse(resp: dict, mode: str) -> tuple[str, bool, int]:
    try:
        choice = resp["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ServerUnavailable(f"not a chat-completion response: {str(resp)[:120]}") from None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    text = apply_reasoning(msg.get("content") or "", reasoning, mode)
    tokens = int((resp.get("usage") or {}).get("completion_tokens") or 0)
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
        with bar.bar, open(tmp, "a", encoding="utf-8") as f:
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
        pool.shutdown(wait=False, cancel_futures=True)
        stats.gen_time_s += time.perf_counter() - t0
