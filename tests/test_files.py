"""dlmjax.io.files: staged directory writes (refused targets, carried-over files, stale staging of
other hosts and processes, one staged write when stages nest)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import dlmjax
from dlmjax.io.files import PARTIAL, _host, staged_dir
from dlmjax.validation import InputError
from dlmjax.config import ModelConfig


def test_the_current_directory_and_its_parents_are_refused(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    for target in [".", "..", str(tmp_path / "work")]:
        with pytest.raises(InputError, match="write into a subdirectory of it instead"):
            with staged_dir(target):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing staged, nothing renamed
    with staged_dir("model") as stage:  # a subdirectory is fine
        (stage / "x").write_text("x")
    assert (tmp_path / "work" / "model" / "x").read_text() == "x"


def test_the_filesystem_root_and_mount_points_are_refused():
    with pytest.raises(InputError, match="is the filesystem root.*write into a subdirectory"):
        with staged_dir("/"):
            pass
    mount = next((m for m in ["/proc", "/sys", "/dev"] if os.path.ismount(m)), None)
    if mount is None:
        pytest.skip("no mount point to try")
    with pytest.raises(InputError, match="is a mount point.*write into a subdirectory"):
        with staged_dir(mount):
            pass


def test_keep_existing_links_the_files_the_block_does_not_write(tmp_path):
    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    (target / "big.bin").write_bytes(b"\0" * 4096)
    (target / "sub" / "a.txt").write_text("a")
    (target / "tokenizer.json").write_text("old")
    (target / "link").symlink_to("big.bin")
    inode = (target / "big.bin").stat().st_ino
    with staged_dir(target, keep_existing=True) as stage:
        assert list(stage.iterdir()) == []  # nothing copied up front
        (stage / "tokenizer.json").write_text("new")
        assert (target / "tokenizer.json").read_text() == "old"  # the old directory is untouched
    assert (target / "tokenizer.json").read_text() == "new"
    assert (target / "big.bin").stat().st_ino == inode  # a hard link, not a copy
    assert (target / "sub" / "a.txt").read_text() == "a"
    assert os.readlink(target / "link") == "big.bin"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_symlinked_target_keeps_its_link_and_the_files_land_where_it_points(tmp_path):
    """`out -> big_disk/models` (the usual way to put checkpoints on another disk): the link used
    to be renamed away and replaced by a directory on the link's own disk, and the stray link left
    beside it broke the next write."""
    (tmp_path / "big_disk" / "models").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    link = tmp_path / "home" / "out"
    link.symlink_to(tmp_path / "big_disk" / "models")
    for version in ("1", "2"):
        with staged_dir(link, keep_existing=True) as stage:
            (stage / f"v{version}.txt").write_text(version)
        assert link.is_symlink()
        assert sorted(p.name for p in (tmp_path / "big_disk" / "models").iterdir()) == [
            f"v{v}.txt" for v in "12"[:int(version)]]
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "big_disk").iterdir()) == ["models"]


def test_only_this_hosts_dead_staging_is_removed(tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours_dead = tmp_path / f".out{PARTIAL}{_host()}-{done.pid}"
        ours_alive = tmp_path / f".out{PARTIAL}{_host()}-{alive.pid}"
        other_host = tmp_path / f".out{PARTIAL}not-{socket.gethostname()}-x-{done.pid}"
        legacy = tmp_path / f".out{PARTIAL}{done.pid}"  # no host: whose it is cannot be told
        for leftover in [ours_dead, ours_alive, other_host, legacy]:
            leftover.mkdir()
        with staged_dir(tmp_path / "out") as stage:
            assert stage.name == f".out{PARTIAL}{_host()}-{os.getpid()}"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["out", ours_alive.name, other_host.name, legacy.name])
    finally:
        alive.kill()
        alive.wait()


def test_a_staged_dir_inside_a_stage_writes_there(tmp_path):
    with staged_dir(tmp_path / "out", keep_existing=True) as stage:
        with staged_dir(stage, keep_existing=True) as inner:
            assert inner == stage
            (inner / "x").write_text("x")
        assert sorted(p.name for p in tmp_path.iterdir()) == [stage.name]  # nothing staged beside it
        assert (stage / "x").read_text() == "x"
    assert (tmp_path / "out" / "x").read_text() == "x"


def test_export_model_into_a_stage_writes_there(tmp_path):
    """`dlmjax export` stages its output and exports into the stage: one staged write."""
    cfg = ModelConfig(family="sdar", attention="block_causal", block_size=4, vocab_size=16, hidden_size=16,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64, qk_norm=True, mask_token_id=15, eos_token_ids=(14,), pad_token_id=13)
    model = dlmjax.init_model(cfg, seed=0)
    with staged_dir(tmp_path / "out", keep_existing=True) as stage:
        dlmjax.export_model(model, stage)
        assert sorted(p.name for p in tmp_path.iterdir()) == [stage.name]
        assert (stage / "config.json").is_file()
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_export_carries_every_tokenizer_file_of_its_source(tmp_path):
    """A SentencePiece model and transformers 5's named chat templates go with the rest."""
    from dlmjax.io.hf import TOKENIZER_FILES

    model = dlmjax.load_model("toy-sdar")
    source = tmp_path / "source"
    (source / "additional_chat_templates").mkdir(parents=True)
    (source / "tokenizer.model").write_bytes(b"\x0a\x03sp")
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (source / "tokenizer.json").write_text("{}")
    out = dlmjax.export_model(model, tmp_path / "out", files_from=source)
    assert (out / "tokenizer.model").read_bytes() == b"\x0a\x03sp" and "tokenizer.model" in TOKENIZER_FILES
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ messages }}"
    by_name = dlmjax.export_model(model, tmp_path / "by-name", files_from="toy-sdar")  # a preset, as load_model takes
    assert (by_name / "tokenizer.json").read_bytes() == (dlmjax.io.hf.checkpoint_path("toy-sdar") / "tokenizer.json"
                                                         ).read_bytes()
