"""Agent replay: a recorded coding-agent session through `mlxcc serve`'s Messages and Responses
APIs and through chat completions on mlx-lm's server, in one run: per-turn TTFT and prompt
tokens computed.

One command (from the repository root):

    .venv/bin/python benchmarks/agent_replay.py                  # demo model (SmolLM2, float32)
    .venv/bin/python benchmarks/agent_replay.py --write-results  # also updates RESULTS.md and the plot
    .venv/bin/python benchmarks/agent_replay.py --tiny --turns 3 --system-chars 1500  # tiny random model, smoke run

The session (``agent_session.json`` beside this script, in the Messages API's shape; made by
``--record`` from this repository's own files, deterministic): a system prompt with an
agent's instructions and its tools' documentation (about 6k tokens, what fits the demo
model's 8k context), then 10 turns, each an assistant turn (a sentence and a ``tool_use``:
Read, Grep, Bash, ...) and its ``tool_result`` (a file's lines, a listing, a command's output).
Request ``t`` sends the system prompt and turns ``1..t`` and asks for ``--max-new`` tokens
(greedy), as an agent resends its whole history every turn. Engines, each a server of its own
(all started first, then each turn sent to each in turn, so they see the same load) loading the
same float32 folder (mlx-lm's server cannot load a GGUF):

- ``mlxcc /v1/messages``: the ``anthropic`` wire format (streamed, ``cache_control`` on the
  system prompt and on the last message, as Claude Code sends);
- ``mlxcc /v1/responses``: OpenAI's Responses wire format (streamed, ``input`` items with
  ``function_call`` / ``function_call_output``, ``store: false`` and a ``prompt_cache_key``,
  as Codex sends);
- ``mlx-lm server``: ``/v1/chat/completions`` (streamed, ``include_usage``) with the same
  messages, ``mlx_lm server`` and its own prompt cache, started after mlx_chatcache's BLAS
  switch (OpenBLAS, as every mlxcc process; ``--blas-threads`` threads in every server).

Per turn: TTFT at the client (request sent -> first text delta), prompt tokens, prompt tokens
computed (prompt - cached, as each server reports it), and the turn's new tokens (this prompt
minus the previous one). Targets: from turn 2 on, computed <= new + one block (64), and mlxcc's
TTFT p50 below mlx-lm's.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from cache_io import OPENBLAS, bench_parser, header_block, md_table, write_results_section  # noqa: E402
from server_load import Server, build_model  # noqa: E402

SESSION = HERE / "agent_session.json"
BLOCK = 64


# ------------------------------------------------------------------ the recorded session
def record(root: Path, system_chars: int = 22500) -> dict:
    """The session from this repository's files (see the module doc)."""
    docs = [root / "docs" / n for n in ("architecture.md", "cli.md", "cache-format.md", "clients.md")]
    tools = []
    for name, what in [("Read", "Read a file of the project, with line numbers."),
                       ("Grep", "Search the project's files for a regular expression."),
                       ("Bash", "Run a shell command in the project folder and return its output."),
                       ("Edit", "Replace an exact string in a file with another."),
                       ("Glob", "List the files whose paths match a pattern.")]:  # fmt: skip
        tools.append({"name": name, "description": what, "input_schema": {"type": "object", "properties": {
            "path": {"type": "string", "description": "a path relative to the project root"},
            "pattern": {"type": "string"}, "command": {"type": "string"}}}})  # fmt: skip
    manual = "\n\n".join(p.read_text() for p in docs)
    system = ("You are a coding agent working in the mlx_chatcache repository. Use the tools to read and "
              "change files; answer briefly. Tools:\n" + "\n".join(json.dumps(t) for t in tools) +
              "\n\nProject manual:\n" + manual)[:system_chars]  # fmt: skip
    files = sorted((root / "mlx_chatcache" / "store").glob("*.py"))
    calls = [("Glob", {"pattern": "mlx_chatcache/store/*.py"}, "\n".join(str(f.relative_to(root)) for f in files))]
    for f in files[:5]:
        lines = f.read_text().splitlines()[:10]
        calls.append(("Read", {"path": str(f.relative_to(root))}, "\n".join(f"{i + 1}\t{s}" for i, s in enumerate(lines))))
    calls += [("Grep", {"pattern": "def put"}, "mlx_chatcache/store/store.py:253:    def put(self, scope, tokens, ..."),
              ("Bash", {"command": "git log --oneline | head -5"}, "4007977 store: puts also serve exactly ...\n"
               "19c4400 Merge lane-namedfiles\n578c8c9 store: values decode only their store fields"),
              ("Edit", {"path": "mlx_chatcache/store/chain.py"}, "The file was edited."),
              ("Bash", {"command": "pytest -q tests/test_store.py"}, "........................ [100%]\n24 passed")]  # fmt: skip
    messages = [{"role": "user", "content": "Find where the store computes its keys and explain it."}]
    for i, (name, args, result) in enumerate(calls[:10]):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i + 1}: I will use {name}."},
            {"type": "tool_use", "id": f"toolu_{i:02d}", "name": name, "input": args}]})  # fmt: skip
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i:02d}",
                                                      "content": result}]})  # fmt: skip
    return {"system": system, "messages": messages}


def turns(session: dict) -> list[list[dict]]:
    """Request ``t``'s messages: the first user message and the first ``t`` turns (1 + 2t messages)."""
    m = session["messages"]
    return [m[: 1 + 2 * t] for t in range(0, (len(m) - 1) // 2)]


# ------------------------------------------------------------------ the three wire formats
def as_chat(session: dict, messages: list[dict]) -> list[dict]:
    out = [{"role": "system", "content": session["system"]}]
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        texts = [b["text"] for b in m["content"] if b["type"] == "text"]
        calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                 for b in m["content"] if b["type"] == "tool_use"]  # fmt: skip
        results = [b for b in m["content"] if b["type"] == "tool_result"]
        if calls or texts:
            out.append({"role": m["role"], "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        out += [{"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"]} for r in results]
    return out


def as_input(messages: list[dict]) -> list[dict]:
    items = []
    for m in messages:
        if isinstance(m["content"], str):
            items.append({"type": "message", "role": m["role"], "content": [{"type": "input_text", "text": m["content"]}]})
            continue
        for b in m["content"]:
            if b["type"] == "text":
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": b["text"]}]})
            elif b["type"] == "tool_use":
                items.append({"type": "function_call", "call_id": b["id"], "name": b["name"], "arguments": json.dumps(b["input"])})
            else:
                items.append({"type": "function_call_output", "call_id": b["tool_use_id"], "output": b["content"]})
    return items


def marked(messages: list[dict]) -> list[dict]:
    """The messages with ``cache_control`` on the last block, as Claude Code marks them."""
    out = json.loads(json.dumps(messages))
    last = out[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


def request(engine: str, session: dict, messages: list[dict], model: str, max_new: int) -> tuple[str, dict]:
    if engine == "messages":
        return "/v1/messages?beta=true", {"model": model, "max_tokens": max_new, "stream": True, "messages": marked(messages),
                                          "system": [{"type": "text", "text": session["system"], "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
    if engine == "responses":
        return "/v1/responses", {"model": model, "max_output_tokens": max_new, "stream": True, "store": False,
                                 "instructions": session["system"], "input": as_input(messages), "prompt_cache_key": "replay"}  # fmt: skip
    return "/v1/chat/completions", {"model": model, "max_tokens": max_new, "stream": True, "temperature": 0,
                                    "stream_options": {"include_usage": True}, "messages": as_chat(session, messages)}  # fmt: skip


def run_turn(port: int, engine: str, path: str, body: dict) -> dict:
    """TTFT (first text delta), prompt and cached tokens of one streamed request."""
    import requests

    t0 = time.perf_counter()
    ttft, usage = None, None
    with requests.post(f"http://127.0.0.1:{port}{path}", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            e = json.loads(line[6:])
            kind = e.get("type")
            text = (kind == "content_block_delta" or kind == "response.output_text.delta"
                    or bool(e.get("choices") and e["choices"][0]["delta"].get("content")))  # fmt: skip
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            if kind == "message_delta":
                u = e["usage"]
                usage = (u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"],
                         u["cache_read_input_tokens"])  # fmt: skip
            elif kind in ("response.completed", "response.incomplete"):
                u = e["response"]["usage"]
                usage = (u["input_tokens"], u["input_tokens_details"]["cached_tokens"])
            elif e.get("usage"):
                usage = (e["usage"]["prompt_tokens"], (e["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    total = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else total, "prompt": usage[0], "cached": usage[1]}


def run_engines(servers: dict, session: dict, args) -> dict:
    """Every turn on every engine, interleaved turn by turn (engines see the same load)."""
    rows = {e: [] for e in servers}
    for t, messages in enumerate(turns(session)):
        for engine, (server, model) in servers.items():
            path, body = request(engine, session, messages, model, args.max_new)
            row = run_turn(server.port, engine, path, body)
            row["turn"] = t + 1
            rows[engine].append(row)
            print(f"{engine:9s} turn {t + 1:2d}: prompt {row['prompt']:5d} cached {row['cached']:5d} "
                  f"TTFT {row['ttft'] * 1e3:7.0f} ms", flush=True)
    for engine, (server, _) in servers.items():
        rows[engine][0]["rss_mb"] = server.peak_rss_mb()
    return rows


def cut_layers(folder: Path, n: int) -> str:
    """Keep the first ``n`` transformer layers of the model in ``folder`` (in place)."""
    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = n
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:n]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    weights = mx.load(str(folder / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    mx.eval(kept)
    mx.save_safetensors(str(folder / "cut.safetensors"), kept, {"format": "mlx"})
    (folder / "cut.safetensors").replace(folder / "model.safetensors")
    return f", cut to its first {n} layer{'s' if n > 1 else ''} (the servers' own per-turn cost shows)"


# ------------------------------------------------------------------ report
ENGINES = {"messages": "mlxcc /v1/messages", "responses": "mlxcc /v1/responses", "mlx-lm": "mlx-lm server (chat)"}


def report(results: dict, desc: str, args, elapsed: float, load: tuple, blas: str) -> tuple[str, dict]:
    lines = [header_block("agent_replay: a 10-turn agent session, per-turn TTFT and prompt tokens computed", blas),
             f"- model: {desc}", f"- load average before / after the run (1 min): {load[0]:.2f} / {load[1]:.2f} "
             "(2 shared cores; other work ran on this machine)", f"- greedy, {args.max_new} new tokens per turn; "
             f"total {elapsed:.0f} s", ""]  # fmt: skip
    headers = ["turn", "new tokens"]
    for e in results:
        headers += [f"{ENGINES[e]} prompt", "computed", "TTFT ms"]
    rows = []
    n = min(len(r) for r in results.values())
    first = next(iter(results.values()))
    for t in range(n):
        new = first[t]["prompt"] - (first[t - 1]["prompt"] if t else 0)
        row = [t + 1, new]
        for r in results.values():
            row += [r[t]["prompt"], r[t]["prompt"] - r[t]["cached"], f"{r[t]['ttft'] * 1e3:.0f}"]
        rows.append(row)
    lines.append(md_table(headers, rows))
    summary, verdict = [], {}
    for e, r in results.items():
        warm = [x["ttft"] for x in r[1:n]]
        over = [r[t]["prompt"] - r[t]["cached"] - (r[t]["prompt"] - r[t - 1]["prompt"]) for t in range(1, n)]
        verdict[e] = {"p50": statistics.median(warm), "max_over_new": max(over)}
        summary.append([ENGINES[e], f"{statistics.median(warm) * 1e3:.0f}", f"{max(warm) * 1e3:.0f}",
                        f"{r[0]['ttft'] * 1e3:.0f}", max(over), f"{r[0].get('rss_mb') or 0:.0f} MB"])  # fmt: skip
    lines.append("Turns 2-10: TTFT p50 and max (ms), turn 1's TTFT, the most prompt tokens computed beyond a turn's "
                 "new tokens, peak RSS:\n")  # fmt: skip
    lines.append(md_table(["engine", "TTFT p50", "TTFT max", "turn 1 TTFT", "computed - new (max)", "peak RSS"],
                          summary))  # fmt: skip
    return "\n".join(lines), verdict


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for e, r in results.items():
        a.plot([x["turn"] for x in r], [x["ttft"] * 1e3 for x in r], marker="o", label=ENGINES[e])
        b.plot([x["turn"] for x in r], [x["prompt"] - x["cached"] for x in r], marker="o", label=ENGINES[e])
    a.set(xlabel="turn", ylabel="TTFT (ms)", yscale="log", title="time to first token")
    b.set(xlabel="turn", ylabel="prompt tokens computed", yscale="log", title="prompt tokens computed")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap, argv = bench_parser(__doc__, argv)
    ap.add_argument("--tiny", action="store_true", help="tiny random model (smoke run)")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10, help="replay the first N turns (smoke runs)")
    ap.add_argument("--system-chars", type=int, default=None, help="cut the system prompt to N characters (smoke runs)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the demo model's first N layers: the servers' own per-turn cost shows (overhead runs)")
    ap.add_argument("--record", action="store_true", help=f"write {SESSION.name} from this repository's files")
    ap.add_argument("--engines", default="messages,responses,mlx-lm")
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--no-openblas", action="store_true")
    ap.add_argument("--blas-threads", type=int, default=1, help="OpenBLAS threads of every server (shared cores)")
    args = ap.parse_args(argv)
    if args.record:
        SESSION.write_text(json.dumps(record(HERE.parent), indent=1) + "\n")
        print(f"wrote {SESSION}")
        return 0
    session = json.loads(SESSION.read_text())
    session["system"] = session["system"][: args.system_chars]
    session["messages"] = session["messages"][: 1 + 2 * args.turns]
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("MLXCC_BLAS_THREADS", str(args.blas_threads))  # the same for every server, whatever the load
    if not args.no_openblas and Path(OPENBLAS).exists():  # every server gets the same BLAS
        env["LD_PRELOAD"] = (OPENBLAS + " " + env.get("LD_PRELOAD", "")).strip()
        os.environ["LD_PRELOAD"] = env["LD_PRELOAD"]
    with tempfile.TemporaryDirectory(prefix="mlxcc-agent-replay-") as tmp, contextlib.ExitStack() as stack:
        folder, desc = build_model(args, Path(tmp))
        if args.layers:
            desc += cut_layers(folder, args.layers)
        servers = {}
        for engine in args.engines.split(","):
            if engine == "mlx-lm":  # booted after mlx_chatcache's BLAS switch, as mlxcc is
                boot = "import mlx_chatcache, runpy, sys; sys.argv[0] = 'mlx_lm'; runpy.run_module('mlx_lm', run_name='__main__')"
                argv_ = [sys.executable, "-c", boot, "server", "--model", str(folder), "--host", "127.0.0.1",
                         "--port", "{port}", "--log-level", "WARNING"]  # fmt: skip
                model = str(folder)
            else:
                argv_ = [sys.executable, "-m", "mlx_chatcache", "serve", "--model", str(folder), "--host", "127.0.0.1",
                         "--port", "{port}", "--log-level", "warning", "--cache-dir", str(Path(tmp) / f"cache-{engine}")]  # fmt: skip
                model = folder.name
            servers[engine] = (stack.enter_context(Server(argv_, env, "/health", args.start_timeout)), model)
        results = run_engines(servers, session, args)
    probe = "import mlx_chatcache; from mlx_chatcache.backend.blas import describe; print(describe())"
    blas = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()
    text, verdict = report(results, desc, args, time.monotonic() - t0, (load0, os.getloadavg()[0]),
                           f"{blas}, in every server (mlx-lm's started after mlx_chatcache's switch)")  # fmt: skip
    print(text)
    if args.write_results:
        plot(results, args.results.parent / "agent_replay.png")
        write_results_section("agent_replay", text + "\n![agent replay](agent_replay.png)\n", args.results)
    ok = all(v["max_over_new"] <= BLOCK for e, v in verdict.items() if e != "mlx-lm")
    if "mlx-lm" in verdict:
        ok = ok and all(v["p50"] < verdict["mlx-lm"]["p50"] for e, v in verdict.items() if e != "mlx-lm")
    print("targets met" if ok else "targets NOT met")
    print("computed - new (max), mlxcc:", max(v["max_over_new"] for e, v in verdict.items() if e != "mlx-lm"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
