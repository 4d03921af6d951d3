"""Model loading: local folders, hub ids resolved offline, clear errors."""

import shutil
import subprocess
import sys

import pytest

from mlx_chatcache.errors import ModelLoadError
from mlx_chatcache.models.loading import load, resolve_model_ref


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="not found"):
        load(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="config.json"):
        load(str(tmp_path))  # a folder that is not a model


def test_hub_id_uncached_offline_is_one_clear_error(monkeypatch):
    code = (
        "from mlx_chatcache.cli.main import main; import sys; "
        "sys.exit(main(['generate', '--model', 'nobody/not-cached', '-p', 'hi']))"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1
    lines = [line for line in p.stderr.splitlines() if line.strip() and "PyTorch" not in line]
    assert len(lines) == 1 and "nobody/not-cached" in lines[0] and "offline" in lines[0]


def test_hub_id_resolved_from_the_offline_cache(tiny_model_dirs, tmp_path):
    """A hub id present in the Hugging Face cache loads with HF_HUB_OFFLINE=1 (no network)."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    rev = "0" * 40
    shutil.copytree(tiny_model_dirs["llama"], repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    code = (
        "from mlx_chatcache import load; m, t = load('tiny-org/tiny-llama'); "
        "print(m.fingerprint.model_id, len(m.layers), t.encode('hi'))"
    )
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("tiny-org/tiny-llama 2 ")


def test_default_model_is_the_demo_when_installed(demo_gguf):
    assert resolve_model_ref(None) == demo_gguf
