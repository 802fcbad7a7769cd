"""Heads on a real model's data: MRP heads and drafters train on JSONL rows (`data.files`) in the
model's own tokenizer and chat template, with the frozen model loaded onto the run's mesh.

The models are tiny random checkpoints with a real BPE tokenizer (trained here, ChatML template);
the rows are JSONL lines as a user's SFT data holds them."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dlmjax.config import ModelConfig
from dlmjax.io.hf import export_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.models.transformer import init_model
from dlmjax.presets import resolve_model
from dlmjax.sharding import make_mesh
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.toy.tasks import Example
from dlmjax.train.data import DataError, FileTask, file_tasks, make_batch, sample_examples
from dlmjax.train.loop import make_trainee, train
from dlmjax.validation import InputError
from test_tokenizer import CHATML, chat_checkpoint

REPO = Path(__file__).resolve().parent.parent
MRP_CONFIG = REPO / "configs/mrp/toy-sdar.yaml"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            max_position_embeddings=256, qk_norm=True)
ROWS = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}. The answer is {a + b}."}
        for a, b in [(3, 4), (12, 7), (5, 5), (20, 1), (9, 8), (6, 11)]]


def real_checkpoint(path, *, attention: str):
    """A random model under a BPE tokenizer with a ChatML template and a mask token."""
    chat_checkpoint(path, CHATML, SPECIALS, {"bos_token": None, "eos_token": "<|im_end|>"})
    vocab = json.loads((path / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    size = max(vocab["model"]["vocab"].values()) + 1
    cfg = ModelConfig(vocab_size=-(-size // 16) * 16, mask_token_id=ids["<|mask|>"], eos_token_ids=(ids["<|im_end|>"],),
                      family="sdar" if attention == "block_causal" else "qwen3", attention=attention, block_size=4,
                      **TINY)
    return export_model(init_model(cfg, seed=0), path)  # beside the tokenizer files


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return real_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", attention="block_causal")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return real_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", attention="causal")


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in ROWS] + ['{"question": "no answer"}', "not json",
                                              json.dumps({"question": "long", "answer": "x " * 200})]
    path.write_text("\n".join(lines) + "\n")
    return path


def file_overrides(model_dir, rows_file, steps=2):
    return [f"backbone={model_dir}", f"data.files={{{rows_file}: 1}}", "data.tasks=null", "data.prompt_field=question",
            "data.response_field=answer", "data.chat=true", "data.seq_len=96", f"train.steps={steps}",
            "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.eval_every=2"]


def test_file_rows_are_the_models_chat_turns_and_bad_lines_are_reported(sdar, rows_file, capsys, monkeypatch):
    monkeypatch.chdir(rows_file.parent)
    relative = load_run_config(MRP_CONFIG, file_overrides(sdar, "train.jsonl"))
    assert list(relative.data.files) == [str(rows_file)]  # recorded absolute: a resume may run elsewhere
    run = load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file))
    tokenizer = load_tokenizer(sdar)
    tasks = file_tasks(run.data, tokenizer, block=4)
    report = capsys.readouterr().out
    assert ("skipped 2 lines without text fields 'question' and 'answer' (row 7: missing or empty 'answer'; "
            "row 8: invalid JSON (Expecting value))") in report
    assert "skipped 1 line longer than data.seq_len=96 tokens (line 9)" in report
    (task,) = tasks.values()
    assert len(task.examples) == len(ROWS)
    examples = sample_examples(run.data.weights, 4, run.data.seed, 1, tasks)
    batch = make_batch(examples, tokenizer, seq_len=96, block=4, pad_id=tokenizer.eos_id)
    first = tokenizer.decode(batch.tokens[0][batch.valid[0]], skip_special_tokens=False)
    prompt = tokenizer.decode(batch.tokens[0][batch.valid[0] & ~batch.target[0]], skip_special_tokens=False)
    row = next(r for r in ROWS if r["answer"] + "<|im_end|>" == examples[0].target)  # the answer's turn
    assert prompt == examples[0].prompt == f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n"
    turn_ends = len(tokenizer.encode_prompt(prompt) + tokenizer.encode(examples[0].target))
    assert first == prompt + examples[0].target + "<|im_end|>" * (-turn_ends % 4)  # EOS up to the block's end

    # a byte-order mark before the first line (Excel's, PowerShell's) is not part of it; a blank answer
    # is no answer, as evaluation reads it
    bom = rows_file.parent / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in [*ROWS[:2], {"question": "q", "answer": " "}]
                                                   ).encode() + b"\n")
    (task,) = file_tasks(load_run_config(MRP_CONFIG, file_overrides(sdar, bom)).data, tokenizer, block=4).values()
    assert [ex.target for ex in task.examples] == [r["answer"] + "<|im_end|>" for r in ROWS[:2]]
    assert "skipped 1 line without text fields 'question' and 'answer' (row 3: missing or empty 'answer')" in (
        capsys.readouterr().out)

    with pytest.raises(DataError, match="no line with text fields 'q' and 'answer'"):
        file_tasks(load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file) + ["data.prompt_field=q"]).data,
                   tokenizer, block=4)
    plain = rows_file.parent / "plain.jsonl"  # a text file: the error says why no line was read
    plain.write_text("just text\n")
    with pytest.raises(DataError, match=r"no line with text fields 'question' and 'answer' \(row 1: invalid JSON"):
        file_tasks(load_run_config(MRP_CONFIG, file_overrides(sdar, plain)).data, tokenizer, block=4)
    toy = load_tokenizer(resolve_model("toy-sdar"))  # no chat template
    with pytest.raises(DataError, match="data.chat: .*set data.chat=false"):
        file_tasks(run.data, toy, block=4)


def test_data_chat_takes_the_templates_variables_as_evaluation_does(sdar, rows_file, tmp_path):
    """`data.chat={enable_thinking: false}`: the rows' prompts are the turns a Qwen3 preset
    evaluates with (it was refused: true or false only)."""
    # Qwen3's template: the last assistant turn opens with an empty think block
    thinking = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n\n</think>"
                "\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    chat_checkpoint(tmp_path / "tok", thinking, SPECIALS, {"bos_token": None, "eos_token": "<|im_end|>"})
    tokenizer = load_tokenizer(tmp_path / "tok")
    for chat, ending, answer_starts in (("true", "assistant\n", "<think>\n\n</think>\n\n"),
                                        ("{enable_thinking: false}", "assistant\n<think>\n\n</think>\n\n", "")):
        run = load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file) + [f"data.chat={chat}"])
        (task,) = file_tasks(run.data, tokenizer, block=4).values()
        assert all(ex.prompt.endswith(ending) for ex in task.examples), chat
        assert [ex.target for ex in task.examples] == [answer_starts + r["answer"] + "<|im_end|>" for r in ROWS], chat
    assert hash(run.data) == hash(load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file)
                                                  + ["data.chat={enable_thinking: false}"]).data)


def test_chat_rows_end_with_the_models_end_of_turn_then_eos(sdar, rows_file, tmp_path, capsys):
    """A chat model stops at its end of turn, which need not be its EOS (LLaDA's <|eot_id|> before
    <|endoftext|>, Dream's <|im_end|>): a row is the answer's turn up to the first stop token after
    the answer's text, then EOS. It ended with EOS alone, so the heads never saw the turn end the
    model writes. A row the template does not write after the generation prompt is skipped and
    reported; a file of nothing else is refused."""
    llada = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
             "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    specials = ["<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|mdm_mask|>"]
    chat_checkpoint(tmp_path / "tok", llada, specials, {"bos_token": None, "eos_token": "<|endoftext|>"})
    tokenizer = load_tokenizer(tmp_path / "tok")
    eos, eot = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|eot_id|>")
    assert tokenizer.stop_ids == (eos,)  # the turn end is no stop id of the tokenizer's
    run = load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file))
    (task,) = file_tasks(run.data, tokenizer, block=None).values()
    assert task.examples[0].target == ROWS[0]["answer"] + "<|eot_id|>"  # no stop id in the turn: kept whole

    two_turns = llada.replace("{{ m.content }}<|eot_id|>", "{{ m.content }}<|eot_id|>\n\nmore<|eot_id|>")
    tokenizer.chat_template = two_turns  # a turn with text after its end: cut after the first stop token
    for stop_ids in ((eos, eot), None):  # the model's (config.json's eos beside the tokenizer's), or
        if stop_ids is None:  # generation_config.json's
            (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))
            tokenizer = load_tokenizer(tmp_path / "tok")
            tokenizer.chat_template = two_turns
        (task,) = file_tasks(run.data, tokenizer, block=None, stop_ids=stop_ids).values()
        assert task.examples[0].target == ROWS[0]["answer"] + "<|eot_id|>"
    batch = make_batch(task.examples[:1], tokenizer, seq_len=96, block=None, pad_id=tokenizer.eos_id)
    row = tokenizer.decode(batch.tokens[0][batch.valid[0] & batch.target[0]], skip_special_tokens=False)
    assert row == ROWS[0]["answer"] + "<|eot_id|><|endoftext|>"
    # a stop token's text inside the answer does not end it
    tokenizer.chat_template = llada
    assert tokenizer.chat_row("q", "end a turn with <|eot_id|>, then", True) == (
        "<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "end a turn with <|eot_id|>, then<|eot_id|>")
    # nor does an answer the markup after it holds ("e" is in "more", "eot" in "<|eot_id|>"): the row
    # ran to the turn's end
    tokenizer.chat_template = two_turns
    for short in ("e", "eot", "id", "|>", "more"):
        assert tokenizer.chat_row("q", short, True)[1] == short + "<|eot_id|>", short
    tokenizer.chat_template = llada

    capsys.readouterr()
    # a template that writes something before the assistant's header for one answer: that row is skipped
    tokenizer.chat_template = llada.replace("{% for m in messages %}", "{% for m in messages %}{% if m.role == "
                                            "'assistant' and '12' in m.content %}[answer]{% endif %}")
    (task,) = file_tasks(run.data, tokenizer, block=None).values()
    assert len(task.examples) == len(ROWS) - 1
    assert ("skipped 1 line the chat template does not write as a prompt turn and an answer turn after it (row 2: "
            "the chat template writes this answer's turn elsewhere") in capsys.readouterr().out
    tokenizer.chat_template = tokenizer.chat_template.replace("'12' in m.content", "true")  # for every answer
    with pytest.raises(DataError, match="data.chat: .*train.jsonl: row 1: the chat template writes this answer's "
                                        "turn elsewhere .*set data.chat=false"):
        file_tasks(run.data, tokenizer, block=None)


def test_file_rows_come_in_epochs_each_row_once_an_epoch():
    """Rows are dealt epoch after epoch, each a shuffle of the whole file, so a pass over the file
    sees every row once (they were drawn with replacement: a third never seen); with two files
    each keeps its own epochs; the same seed and step give the same rows (a resume's)."""
    a = FileTask("a.jsonl", tuple(Example(prompt=f"a{i}", target="x") for i in range(10)))
    b = FileTask("b.jsonl", tuple(Example(prompt=f"b{i}", target="x") for i in range(7)))
    drawn = [ex.prompt for step in range(5) for ex in sample_examples({"a.jsonl": 1}, 4, 0, step, {"a.jsonl": a})]
    assert sorted(drawn[:10]) == sorted(drawn[10:20]) == [f"a{i}" for i in range(10)] and drawn[:10] != drawn[10:20]
    both = {"a.jsonl": a, "b.jsonl": b}
    mixed = [[ex.prompt for ex in sample_examples({"a.jsonl": 1, "b.jsonl": 3}, 3, 1, step, both)] for step in range(60)]
    for name, task in (("a", a), ("b", b)):
        rows = [p for batch in mixed for p in batch if p.startswith(name)]
        n = len(task.examples)
        assert len(rows) >= 2 * n and all(sorted(rows[e * n:(e + 1) * n]) == sorted(ex.prompt for ex in task.examples)
                                          for e in range(len(rows) // n))
    # a resumed run (nothing kept in memory) gets the same rows at the same step
    from dlmjax.train import data

    data._TASK_DRAWS.clear()
    assert [ex.prompt for ex in sample_examples({"a.jsonl": 1, "b.jsonl": 3}, 3, 1, 59, both)] == mixed[59]


def test_an_mrp_head_trains_on_a_real_models_rows_and_resumes(sdar, rows_file, tmp_path):
    run = load_run_config("configs/mrp/toy-sdar.yaml", file_overrides(sdar, rows_file, steps=3))
    stopped = train(run, tmp_path / "run", stop_at=2, progress=False)
    assert stopped.step == 2
    done = train(run, tmp_path / "run", progress=False)
    assert done.step == 3 and done.model_dir is not None
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {k for row in rows for k in row if k.startswith("eval/")}
    assert {"eval/train.jsonl/kl", "eval/train.jsonl/kl_baseline"} <= evals  # the file named by its name
    assert all(np.isfinite(row["loss"]) for row in rows if "loss" in row)
    straight = train(run, tmp_path / "straight", progress=False)
    assert straight.losses[3] == done.losses[3]  # the resumed run saw the batches it would have seen
    # a resume on edited data would see other rows: refused
    run6 = load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file, steps=6))
    train(run6, tmp_path / "edited", stop_at=2, progress=False)
    rows_file.write_text(rows_file.read_text() + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(InputError, match="has changed since this run began"):
        train(run6, tmp_path / "edited", progress=False)


def test_a_home_path_and_a_directory_are_recorded_by_the_file_read(sdar, rows_file, tmp_path, monkeypatch):
    """`~/rows.jsonl` and a directory of rows were left out of data.json, so a resume on an edited
    file went unnoticed."""
    from dlmjax.train.loop import DATA_RECORD, check_data_files

    monkeypatch.setenv("HOME", str(rows_file.parent))
    for source, read in (("~/train.jsonl", rows_file), (str(rows_file.parent), rows_file)):
        run = load_run_config(MRP_CONFIG, file_overrides(sdar, source))
        assert list(run.data.files) == [str(rows_file) if source.startswith("~") else source]
        run_dir = tmp_path / f"run{len(source)}"
        run_dir.mkdir()
        check_data_files(run, run_dir, resuming=False, main=True)
        assert str(read) in json.loads((run_dir / DATA_RECORD).read_text())
    # one file under two names was one entry of the first weight
    with pytest.raises(RunConfigError, match=r"data.files names one file twice \(~/train.jsonl, .*train.jsonl\)"):
        load_run_config(MRP_CONFIG, file_overrides(sdar, rows_file)[:1] + [
            f"data.files={{~/train.jsonl: 1, {rows_file}: 1}}"] + file_overrides(sdar, rows_file)[2:])


def test_a_drafter_trains_on_a_real_targets_rows(qwen3, rows_file, tmp_path):
    overrides = file_overrides(qwen3, rows_file) + ["drafter.target_layer_ids=[0, 1]", "drafter.block_size=4",
                                                    "drafter.anchors_per_row=2", "drafter.eval_prompts=2"]
    with pytest.raises(RunConfigError, match="names no mask token: set drafter.mask_token_id"):
        make_trainee(load_run_config("configs/drafter/toy-ar.yaml", overrides), tmp_path)
    mask = load_tokenizer(qwen3).backend.token_to_id("<|mask|>")
    run = load_run_config("configs/drafter/toy-ar.yaml", overrides + [f"drafter.mask_token_id={mask}"])
    result = train(run, tmp_path / "run", progress=False)
    assert (result.model_dir / "config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accepted = [row["eval/train.jsonl/accept_len"] for row in rows if "eval/train.jsonl/accept_len" in row]
    assert accepted and all(a >= 1.0 for a in accepted)


def test_a_real_model_without_files_and_files_for_a_backbone_are_refused(sdar, rows_file, tmp_path):
    run = load_run_config("configs/mrp/toy-sdar.yaml", [f"backbone={sdar}"])
    with pytest.raises(RunConfigError, match=r"train on its own data \(data.files"):
        make_trainee(run, tmp_path)
    with pytest.raises(RunConfigError, match="data.files trains a head on a real model's data"):
        load_run_config("configs/toy-sdar.yaml", [f"data.files={{{rows_file}: 1}}", "data.tasks=null"])
    with pytest.raises(RunConfigError, match="data.files takes the place of data.tasks"):
        load_run_config("configs/mrp/toy-sdar.yaml", [f"backbone={sdar}", f"data.files={{{rows_file}: 1}}"])  # tasks too
    with pytest.raises(RunConfigError, match="read the rows of data.files"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["data.chat=true"])


def test_the_frozen_model_loads_onto_the_mesh_not_whole_on_one_device(sdar, rows_file, tmp_path):
    mesh = make_mesh(model=2)
    run = load_run_config("configs/mrp/toy-sdar.yaml", file_overrides(sdar, rows_file))
    trainee = make_trainee(run, tmp_path, mesh)
    shardings = {a.sharding for a in jax.tree.leaves(nnx.state(trainee.frozen))}
    assert all(getattr(s, "mesh", None) == mesh for s in shardings)
    assert any("model" in str(s.spec) for s in shardings)  # tensor-parallel weights, split over 'model'
