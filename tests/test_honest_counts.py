"""Every count ``mlxcc chat`` prints is what happened: each one is compared with the token ids
the model was actually fed (every model call is recorded), on the tiny models, in-process.

- a turn's ``[stats]``: ``new`` is the number of prompt tokens fed, ``reused`` the rest of the
  prompt (which the cache held), and the reused and fed ids together are the rendered prompt;
- a new system prompt keeps the cache's common start, and the history read again behind it
  counts as recomputed: as many tokens as the longest run the turn fed of what the model had
  read of the messages after the old system prompt;
- what a line promises for the next turn (``/system``, a resume, an ``/undo`` the cache could
  not follow) is what that turn then feeds and recomputes.
"""

from __future__ import annotations

import difflib
import io
import re
import sys

import mlx.core as mx
import pytest

import mlx_chatcache.generation.feed as feed
import mlx_chatcache.generation.loop as loop
import mlx_chatcache.generation.model_call as model_call
import mlx_chatcache.generation.run as run
import mlx_chatcache.generation.speculative as speculative
import mlx_chatcache.generation.untokenized as untokenized
from mlx_chatcache.cli.main import main
from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.generation.templates import render_chat
from mlx_chatcache.generation.text import as_tokenizer_wrapper
from mlx_chatcache.models.loading import load_tokenizer

STATS = re.compile(r"\[stats\] prompt: (\d+) new \+ (\d+) reused tokens \((\d+) recomputed\).*reply: (\d+) tokens")
COST = re.compile(r"(\d+) tokens? in the cache: the next turn feeds (\d+) tokens? before your message, (\d+) of them "
                  r"recomputed")  # fmt: skip
UNDONE = re.compile(r"the cache could not be rolled back: (\d+) tokens? will be recomputed")


class Lines(io.StringIO):
    """stdin that notes how many model calls had run when each line was read: the calls made
    between two reads are the work of the line read first."""

    def __init__(self, text: str, calls: list):
        super().__init__(text)
        self.calls, self.marks = calls, []

    def readline(self, *args):
        self.marks.append(len(self.calls))
        return super().readline(*args)


@pytest.fixture
def fed(monkeypatch):
    """Every model call's token ids, in order."""
    calls: list[list[int]] = []
    real = model_call.call_model

    def recording(model, tokens, cache, **kw):
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, mx.array) else [int(t) for t in tokens]
        calls.append(ids)
        return real(model, tokens, cache, **kw)

    for module in (feed, loop, run, speculative, untokenized):  # every caller of the chat's model
        monkeypatch.setattr(module, "call_model", recording)
    return calls


@pytest.fixture
def run_chat(tmp_path, monkeypatch, capsys, fed):
    """``run_chat(model_dir, lines, *flags) -> (stdout + stderr, per-line fed ids)``."""
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))

    def run(model_dir, lines: list[str], *flags: str):
        stdin = Lines("".join(line + "\n" for line in lines), fed)
        monkeypatch.setattr(sys, "stdin", stdin)
        capsys.readouterr()
        rc = main(["chat", "--model", str(model_dir), "--max-tokens", "6", "-v", *flags])
        out, err = capsys.readouterr()
        assert rc == 0, err
        bounds = stdin.marks + [len(fed)]  # line i's work: between its read and the next
        return out + err, [sum(fed[a:b], []) for a, b in zip(bounds, bounds[1:])][: len(lines)]

    return run


def turn_counts(err: str) -> list[dict]:
    return [dict(zip(("new", "reused", "recomputed", "generated"), map(int, m.groups()))) for m in STATS.finditer(err)]


def check_fed(counts: dict, ids: list[int]) -> list[int]:
    """The prompt ids a turn fed: ``new`` of them, then one call per reply token but the last."""
    assert len(ids) == counts["new"] + counts["generated"] - 1, (counts, len(ids))
    return ids[: counts["new"]]


def tokenizer(model_dir):
    return as_tokenizer_wrapper(load_tokenizer(str(model_dir)))


def longest_run(seen: list[int], fed_ids: list[int]) -> int:
    m = difflib.SequenceMatcher(None, seen, fed_ids, autojunk=False).find_longest_match(0, len(seen), 0, len(fed_ids))
    return m.size


def test_every_printed_count_is_what_the_model_was_fed(tiny_model_dirs, run_chat, tmp_path):
    d = tiny_model_dirs["llama"]
    session = tmp_path / "s.safetensors"
    err, work = run_chat(d, ["Good morning!", "What is the capital of Italy?"], "--session-file", str(session),
                         "--system-prompt", "Keep your answers short.")  # fmt: skip
    first, second = turn_counts(err)
    assert first["reused"] == 0 and first["recomputed"] == second["recomputed"] == 0
    check_fed(first, work[0])
    check_fed(second, work[1])
    info = read_cache_info(session)
    system = render_chat(tokenizer(d), info.messages[:1], add_generation_prompt=False)
    assert info.tokens[: len(system)] == system
    history = list(info.tokens[len(system) :])  # what the model has read of the messages after it
    assert second["reused"] == first["new"] + first["generated"] - 1  # the whole first turn, as fed

    lines = ["/system Answer like a pirate, in rhymes.", "Ahoy?", "/show stats", '/system ""', "/bye"]
    err, work = run_chat(d, lines, "--session-file", str(session))
    said = COST.search(err.split("[system prompt set")[1])
    assert said, err
    kept, feeds, again = map(int, said.groups())
    (turn,) = turn_counts(err)
    ids = check_fed(turn, work[1])
    # the cache kept its common start with the new prompt; the rest is fed, and the history read
    # again behind the new system prompt (the longest run of it the turn fed) counts as recomputed
    assert turn["reused"] == kept > 0 and turn["new"] > feeds > again > 0
    assert turn["recomputed"] == again == longest_run(history, ids)
    assert f"({again} of them recomputed)" in err.split("this run:")[1]
    # the system prompt removed: the cache keeps the common start, the session file says what it holds
    said = COST.search(err.split("[system prompt removed")[1])
    kept, feeds, again = map(int, said.groups())
    info = read_cache_info(session)
    assert len(info.tokens) == kept and len(info.messages) == 6
    saved = COST.search(err.split(f"[saved to {session}: ")[1])  # said again as the chat ends
    assert tuple(map(int, saved.groups())) == (kept, feeds, again)

    # resumed: the promised cost is the next turn's, counted against what the model is fed
    err, work = run_chat(d, ["Again?"], "--session-file", str(session))
    assert tuple(map(int, COST.search(err.split("resumed session")[1]).groups())) == (kept, feeds, again)
    (turn,) = turn_counts(err)
    ids = check_fed(turn, work[0])
    assert turn["reused"] == kept and turn["recomputed"] == again and turn["new"] > feeds
    assert ids[:feeds] == read_cache_info(session).tokens[kept : kept + feeds]  # the tokens it held, as they were


def test_an_undo_the_cache_cannot_follow_recomputes_what_it_said(tiny_model_dirs, run_chat, tmp_path):
    """A hybrid model's recurrent layers cannot trim back: a new system prompt starts its cache
    afresh, and an undo past the turn after it (no checkpoint left) says how many tokens the
    next turn recomputes; that turn recomputes them."""
    d = tiny_model_dirs["hybrid"]
    lines = ["Good morning!", "/system Be brief.", "What is the capital of Italy?", "/undo", "/undo", "Hello."]
    err, work = run_chat(d, lines, "--session-file", str(tmp_path / "h.safetensors"), "--max-tokens", "3")
    turns = turn_counts(err)
    said = [int(m.group(1)) for m in UNDONE.finditer(err)]
    assert len(turns) == 3 and len(said) == 1, err
    for counts, ids in zip(turns, [work[0], work[2], work[5]]):
        check_fed(counts, ids)
    assert turns[1]["reused"] == 0 and turns[1]["recomputed"] > 0  # the history behind the new system prompt
    assert turns[2]["reused"] == 0 and turns[2]["recomputed"] == said[0] > 0
