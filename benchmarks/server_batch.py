"""Continuous batching under load: 1, 2, 4 and 8 concurrent streamed chat
clients against ``mlxcc serve`` (batched, and with ``--max-batch 1``) and
mlx-lm's server, on loopback, in one run.

One command (from the repository root):

    .venv/bin/python benchmarks/server_batch.py                  # SmolLM2 as float32, table + server_batch.png
    .venv/bin/python benchmarks/server_batch.py --write-results  # also updates RESULTS.md
    .venv/bin/python benchmarks/server_batch.py --tiny --clients 1,2  # tiny random model, smoke run

Scenario (``server_load.py``'s conversations and servers): each client is one
conversation with the shared ~300-token system prompt; its turns run one after
the other, the clients concurrently; greedy, ``--max-new`` tokens per reply
(``ignore_eos`` is not in the OpenAI dialect, so replies may end early: the
table counts the tokens each server reports). Per engine and client count, on
a fresh server: aggregate decode tokens/s (every reply's tokens after its
first, over the seconds in which at least one reply was decoding), p50/p95 TTFT of warm turns (turn 2 on: the
conversation's earlier turns are in the cache), mlxcc's mean queue wait,
errors, the server's peak RSS, and how many replies equal mlxcc's one-at-a-time
replies (greedy: batching must not change an answer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cache_io import OPENBLAS, header_block, md_table, write_results_section  # noqa: E402
from server_load import TURNS, Server, build_model, run_clients  # noqa: E402

PNG = HERE / "server_batch.png"


def one_run(name: str, argv: list[str], env: dict, model_id: str, clients: int, args, deadline: float) -> dict:
    """``clients`` conversations x ``args.turns`` turns on a fresh server."""
    from chat_latency import SYSTEM_PROMPT

    convs = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(clients)]
    rows: list[dict] = []
    with Server(argv, env, "/health", args.start_timeout) as server:
        t0 = time.perf_counter()
        errors = run_clients(server, model_id, convs, range(args.turns), args, deadline, rows, name)
        wall = time.perf_counter() - t0
        health = server.get("/health") if "mlx_chatcache" in argv else {}
        rss = server.peak_rss_mb()
    warm = sorted(r["ttft"] for r in rows if r["turn"] > 1)
    done = sum(max((r["completion_tokens"] or 0) - 1, 0) for r in rows)  # the first token ends the TTFT
    decoding = _covered([(r["started"] + r["ttft"], r["started"] + r["total_s"]) for r in rows])
    jobs = max(health.get("jobs", 0), 1)
    return {"name": name, "clients": clients, "errors": errors, "rows": rows, "wall": wall,
            "tok_s": done / decoding if decoding else 0.0, "completion_tokens": done,
            "p50": _pct(warm, 50), "p95": _pct(warm, 95), "rss": rss,
            "queue_wait": health.get("queue_wait_s_total", 0.0) / jobs if health else None,
            "batch": health.get("batch"), "store": (health.get("store") or {}).get("memory"),
            "replies": [[m["content"] for m in c if m["role"] == "assistant"] for c in convs]}  # fmt: skip


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``spans`` runs (a reply was decoding)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _store(tier: dict | None) -> str:
    """The memory tier's bytes against its budget, at the end of a run."""
    if not tier:
        return "-"
    return f"{tier['bytes'] / 1e6:.1f} / {tier['budget'] / 1e6:.0f} MB"


def report(runs: list[dict], args, desc: str, elapsed: float) -> str:
    blas = f"{args.blas}, in every server (mlx_chatcache's switch, also run before mlx-lm's server)"
    out = [header_block("server_batch: continuous batching, 1-8 clients", blas), f"- model: {desc}",
           f"- load: N concurrent streamed clients x {args.turns} turns, greedy, <= {args.max_new} new tokens, "
           "~300-token shared system prompt; each engine and N on a fresh server", f"- total time {elapsed:.0f} s",
           "", "Aggregate decode tokens/s (replies' tokens after the first, over the time any reply was decoding), warm-turn TTFT p50/p95 in ms, "
           "mlxcc's mean queue wait in ms, errors, peak RSS, mlxcc's memory tier at the end against its budget:\n"]  # fmt: skip
    solo = {r["clients"]: r for r in runs if r["name"] == "mlxcc --max-batch 1"}
    table = []
    for r in runs:
        ref = solo.get(r["clients"])
        same = "-"
        if ref is not None and r is not ref:
            pairs = [(a, b) for ca, cb in zip(r["replies"], ref["replies"]) for a, b in zip(ca, cb)]
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        table.append([r["name"], r["clients"], f"{r['tok_s']:.1f}", _ms(r["p50"]), _ms(r["p95"]),
                      _ms(r["queue_wait"]), len(r["errors"]), "n/a" if r["rss"] is None else f"{r['rss']:.0f} MB",
                      _store(r["store"]), same])  # fmt: skip
    out.append(md_table(["engine", "clients", "decode tok/s", "warm TTFT p50", "p95", "queue wait", "errors",
                         "peak RSS", "store / budget", "replies = one-at-a-time"], table))  # fmt: skip
    out.append("")
    by = {(r["name"], r["clients"]): r for r in runs}
    for name in dict.fromkeys(r["name"] for r in runs):
        one, four = by.get((name, 1)), by.get((name, 4))
        if one and four and one["tok_s"]:
            out.append(f"- {name}: 4 clients give {four['tok_s'] / one['tok_s']:.2f}x the decode tokens/s of 1 client")
    for n in sorted({r["clients"] for r in runs}):
        ours, lm = by.get(("mlxcc (batched)", n)), by.get(("mlx-lm server", n))
        if ours and lm and ours["p50"] and lm["p50"]:
            out.append(f"- {n} clients: mlxcc's warm TTFT p50 is {ours['p50'] / lm['p50']:.2f}x mlx-lm server's")
    for r in runs:
        for err in r["errors"][:3]:
            out.append(f"  - {r['name']}, {r['clients']} clients: {err}")
    return "\n".join(out) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["name"] for r in runs):
        rs = [r for r in runs if r["name"] == name]
        xs = [r["clients"] for r in rs]
        a.plot(xs, [r["tok_s"] for r in rs], marker="o", label=name)
        b.plot(xs, [(r["p50"] or 0) * 1000 for r in rs], marker="o", label=name)
    a.set(xlabel="concurrent clients", ylabel="aggregate decode tokens/s", title="Throughput")
    b.set(xlabel="concurrent clients", ylabel="warm-turn TTFT p50 (ms)", title="Time to first token")
    for ax in (a, b):
        ax.set_xticks(sorted({r["clients"] for r in runs}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model (smoke run)")
    ap.add_argument("--clients", default="1,2,4,8", help=f"client counts, comma-separated (each <= {len(TURNS)})")
    ap.add_argument("--turns", type=int, default=3, help="turns per client (max 4)")
    ap.add_argument("--max-new", type=int, default=48, help="new tokens per reply at most")
    ap.add_argument("--max-batch", type=int, default=None, help="mlxcc's --max-batch (default: its own)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's server")
    ap.add_argument("--time-limit", type=float, default=2400, help="seconds for the whole run")
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--no-openblas", action="store_true", help="keep the mlx wheel's reference BLAS")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--plot", type=Path, default=PNG)
    args = ap.parse_args(argv)
    counts = [max(1, min(int(c), len(TURNS))) for c in args.clients.split(",")]
    args.turns = max(1, min(args.turns, 4))
    t0 = time.monotonic()
    deadline = t0 + args.time_limit
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.no_openblas:
        env["MLXCC_BLAS"] = os.environ["MLXCC_BLAS"] = "off"
    elif Path(OPENBLAS).exists():  # every server gets the same BLAS
        env["LD_PRELOAD"] = (OPENBLAS + " " + env.get("LD_PRELOAD", "")).strip()
        os.environ["LD_PRELOAD"] = env["LD_PRELOAD"]
    probe = "import mlx_chatcache; from mlx_chatcache.backend.blas import describe; print(describe())"
    args.blas = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory(prefix="mlxcc-server-batch-") as tmp:
        folder, desc = build_model(args, Path(tmp))
        mlxcc = [sys.executable, "-m", "mlx_chatcache", "serve", "--model", str(folder), "--host", "127.0.0.1",
                 "--port", "{port}", "--log-level", "warning", "--disk-cache-bytes", "0"]  # fmt: skip
        batched = mlxcc + ([] if args.max_batch is None else ["--max-batch", str(args.max_batch)])
        engines = [("mlxcc --max-batch 1", mlxcc + ["--max-batch", "1"], folder.name),
                   ("mlxcc (batched)", batched, folder.name)]  # fmt: skip
        if not args.no_mlx_lm:
            # mlx-lm's server on the same BLAS as mlxcc (mlx_chatcache's import switches it, see README)
            boot = "import mlx_chatcache, runpy, sys; sys.argv[0] = 'mlx_lm'; runpy.run_module('mlx_lm', run_name='__main__')"
            lm = [sys.executable, "-c", boot, "server", "--model", str(folder), "--host", "127.0.0.1",
                  "--port", "{port}", "--log-level", "WARNING"]  # fmt: skip
            engines.append(("mlx-lm server", lm, str(folder)))
        for n in counts:  # engines interleaved: each client count compares runs close in time
            for name, argv_, model_id in engines:
                if time.monotonic() < deadline:
                    runs.append(one_run(name, argv_, env, model_id, n, args, deadline))
        runs.sort(key=lambda r: [e[0] for e in engines].index(r["name"]))  # the table: by engine
        text = report(runs, args, desc, time.monotonic() - t0)
    print(text)
    plot(runs, args.plot)
    print(f"plot: {args.plot}")
    if args.write_results:
        write_results_section("server_batch", text + f"\n![throughput and TTFT vs clients]({args.plot.name})\n",
                              args.results)  # fmt: skip
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
