"""Settings a chat session keeps: the cache shape it was made with (``--kv-bits``,
``--max-kv-size``...) is refused in one line when a resume asks for another, as
``mlxcc generate`` refuses a cache file's. Transcript tests on the real command."""

from __future__ import annotations

import pytest

from test_chat_cli import RESUMED, TURNS, chat, home, script, stats  # noqa: F401 (fixtures)


@pytest.mark.parametrize("made,asked,said", [
    ((), ("--kv-bits", "8"), "was made with kv_bits=None but kv_bits=8 was asked"),
    ((), ("--max-kv-size", "64"), "was made with max_kv_size=None but max_kv_size=64 was asked"),
    (("--kv-bits", "8"), ("--kv-bits", "4"), "was made with kv_bits=8 but kv_bits=4 was asked"),
    (("--max-kv-size", "64"), ("--max-kv-size", "80"), "was made with max_kv_size=64 but max_kv_size=80"),
    (("--kv-bits", "8"), ("--kv-group-size", "32"), "was made with kv_group_size=64 but kv_group_size=32"),
])  # fmt: skip
def test_a_session_refuses_other_cache_settings_in_one_line(made, asked, said, tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    assert chat(d, script(TURNS[0]), "--session", "s", *made)[0] == 0
    path = home / "sessions" / "s.safetensors"
    before = path.read_bytes()
    rc, out, err = chat(d, script(TURNS[1]), "--session", "s", *asked)
    assert rc == 1 and out == ""
    assert err.strip().count("\n") == 0 and said in err and "use the same settings" in err, err
    assert path.read_bytes() == before
    # the same settings (or none: the session's) resume it with nothing recomputed
    for flags in (made, ()):
        rc, out, err = chat(d, script(), "--session", "s", *flags)
        assert rc == 0 and RESUMED.search(err), err
    rc, out, err = chat(d, script(TURNS[1]), "--session", "s", *made)
    assert rc == 0 and stats(err)[0]["recomputed"] == 0
