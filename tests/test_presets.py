"""Evaluation presets (dlmjax/eval_presets): every preset loads and validates, agrees with its family's
defaults, refuses a checkpoint that is not its model, and `dlmjax eval --preset` runs its table."""

import json
from pathlib import Path

import pytest

from dlmjax.cli import main as cli_main
from dlmjax.config import FAMILIES, ModelConfig
from dlmjax.decoding.spec import parse_decoder
from dlmjax.evaluation.tasks import EVAL_TASKS
from dlmjax.heads.mrp import init_head, load_head, save_head
from dlmjax.io.hf import export_model, load_config
from dlmjax.io.tokenizer import Tokenizer
from dlmjax.models.transformer import init_model
from dlmjax.presets import eval_preset_names, load_eval_preset
from dlmjax.validation import InputError

NAMES = eval_preset_names()
SEED_MODELS = {"sdar-1.7b-chat", "sdar-4b-chat", "sdar-8b-chat", "sdar-1.7b-mrp", "sdar-4b-mrp", "sdar-8b-mrp",
               "llada-8b-instruct", "dream-7b-instruct", "qwen3-8b",
               # MoE checkpoints and Fast-dLLM v2 (issue 21)
               "llada-moe-7b-a1b-instruct", "llada2.0-mini", "llada2.1-mini", "sdar-30b-a3b-chat", "fast-dllm-v2-7b",
               "qwen3-30b-a3b"}


def test_every_seed_model_has_a_preset():
    assert SEED_MODELS <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_preset_loads_validates_and_agrees_with_its_family(name):
    preset = load_eval_preset(name)
    family = FAMILIES[preset.family]
    assert preset.name == name == Path(preset.path).stem
    assert preset.mask_token_id == family.default_mask_token_id  # the family's mask id (None for AR)
    assert preset.chat  # instruct/chat checkpoints: prompts through their own template
    assert set(preset.tasks) <= set(EVAL_TASKS) - {"toy-arith", "toy-constraint"}
    for spec in preset.decoders:
        decoder = parse_decoder(spec)
        if family.attention == "bidirectional":  # a decoding block only where the model has none
            assert getattr(decoder, "block", None) in (None, preset.block_size)
    if family.attention == "block_causal":
        assert preset.block_size is not None
    if family.attention == "causal":
        assert preset.block_size is None and set(preset.decoders) <= {"ar", "drafter"}
    # a checkpoint of the model the preset describes passes its check
    preset.check_model(ModelConfig(family=preset.family, vocab_size=8, hidden_size=8, intermediate_size=8,
                                   num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, attention=family.attention,
                                   block_size=preset.block_size if family.attention == "block_causal" else None,
                                   mask_token_id=preset.mask_token_id))


def test_the_seed_settings_the_presets_carry():
    mrp = load_eval_preset("sdar-8b-mrp")
    assert mrp.block_size == 16 and mrp.checkpoint == "heavyball/sdar-8b-mrp-3lyr"
    assert {"static", "mrp-spec:drafts=1", "mrp-spec:drafts=4", "mrp-remask:tau=0.5,delta=1.0"} <= set(mrp.decoders)
    assert "gsm8k-cot" in mrp.tasks and "gsm8k" not in mrp.tasks  # GSM8K_SETTING 0shot_cot
    # the SDAR and MRP authors' OpenCompass datasets: 0-shot CoT GSM8K, instructed HumanEval, sanitized MBPP
    for name in ("sdar-1.7b-chat", "sdar-4b-chat", "sdar-8b-chat", "sdar-30b-a3b-chat", "sdar-1.7b-mrp",
                 "sdar-4b-mrp", "sdar-8b-mrp"):
        assert set(load_eval_preset(name).tasks) == {"gsm8k-cot", "math500", "humaneval-instruct", "mbpp-sanitized"}
    remask = parse_decoder(next(d for d in mrp.decoders if d.startswith("mrp-remask")))  # the seed's row first
    assert (remask.rule, remask.head_input, remask.head_context) == ("residual", "pre", "block")
    assert load_eval_preset("sdar-1.7b-chat").block_size == 4
    llada = load_eval_preset("llada-8b-instruct")
    assert set(llada.tasks.values()) == {256} and "threshold:tau=0.9,block=32" in llada.decoders
    qwen = load_eval_preset("qwen3-8b")
    assert qwen.drafter == "z-lab/Qwen3-8B-DFlash-b16" and qwen.chat_template_vars == {"enable_thinking": False}
    # the PSD and TSPD seeds' LLaDA-MoE setting: blocks of 32, threshold 0.9, PSD and CE over it
    moe = load_eval_preset("llada-moe-7b-a1b-instruct")
    assert moe.family == "llada_moe" and moe.mask_token_id == 156895 and moe.block_size == 32
    assert {"threshold:tau=0.9,block=32", "psd:policy=threshold,tau=0.9,depth=4,block=32",
            "ce:tau=0.9,depth=4,block=32"} <= set(moe.decoders)
    assert load_eval_preset("llada2.0-mini").decoders[0] == "llada2"  # tau 0.95, 32 steps, block 32
    assert "llada2:tau=0.7,editing_threshold=0.5,max_post_steps=16" in load_eval_preset("llada2.1-mini").decoders
    assert load_eval_preset("sdar-30b-a3b-chat").mask_token_id == load_eval_preset("sdar-8b-chat").mask_token_id
    # eval.py's default, and what eval_script.sh runs for gsm8k and minerva_math
    assert load_eval_preset("fast-dllm-v2-7b").decoders == ["fast-dllm-v2", "fast-dllm-v2:tau=1"]


def test_a_checkpoint_that_is_not_the_presets_model_is_refused():
    preset = load_eval_preset("sdar-8b-mrp")
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=8)
    with pytest.raises(InputError, match="family sdar.*llada model.*heavyball/sdar-8b-mrp-3lyr"):
        preset.check_model(ModelConfig(family="llada", attention="bidirectional", mask_token_id=126336, **base))
    with pytest.raises(InputError, match="mask token id 151669; the checkpoint has 5"):
        preset.check_model(ModelConfig(family="sdar", attention="block_causal", block_size=16, mask_token_id=5, **base))
    with pytest.raises(InputError, match="blocks of 16; the checkpoint's block_size is 4.*sdar-8b-chat|blocks of 16"):
        preset.check_model(ModelConfig(family="sdar", attention="block_causal", block_size=4, mask_token_id=151669,
                                       **base))


def _write(tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


GOOD = """name: toy
checkpoint: toy-sdar
family: sdar
mask_token_id: 3
block_size: 8
chat: false
tasks: {toy-arith: 16}
decoders: [static, "threshold:tau=0.9"]
batch_size: 4
"""


def test_malformed_presets_are_refused_with_the_fix(tmp_path):
    with pytest.raises(InputError, match="neither a YAML file nor a preset; presets: .*sdar-8b-mrp"):
        load_eval_preset("sdar-9b")
    with pytest.raises(InputError, match=r"unknown keys \['gen_length'\]"):
        load_eval_preset(_write(tmp_path, GOOD + "gen_length: 5\n"))
    with pytest.raises(InputError, match=r"missing keys \['decoders'\]"):
        load_eval_preset(_write(tmp_path, "\n".join(l for l in GOOD.splitlines() if not l.startswith("decoders"))))
    with pytest.raises(InputError, match="task 'gsm9k'; tasks: "):
        load_eval_preset(_write(tmp_path, GOOD.replace("toy-arith", "gsm9k")))
    with pytest.raises(InputError, match="unknown decoder|not a decoder|decoders:"):
        load_eval_preset(_write(tmp_path, GOOD.replace('"threshold:tau=0.9"', '"fastest"')))
    with pytest.raises(InputError, match="needs its mask_token_id"):
        load_eval_preset(_write(tmp_path, GOOD.replace("mask_token_id: 3", "mask_token_id: null")))
    with pytest.raises(InputError, match="block_size"):
        load_eval_preset(_write(tmp_path, GOOD.replace("block_size: 8", "block_size: 0")))
    with pytest.raises(InputError, match="sdar decodes in blocks; set block_size"):
        load_eval_preset(_write(tmp_path, GOOD.replace("block_size: 8", "block_size: null")))
    with pytest.raises(InputError, match="tspd: unknown option 'bogus'"):  # named at load, before any model
        load_eval_preset(_write(tmp_path, GOOD.replace('"threshold:tau=0.9"', '"tspd:bogus=1"')))
    # an option out of its range names the file, the decoder and the range (TSPD's too, not built at load)
    for spec, message in (("threshold:tau=2", r"threshold: tau=2.0 must be in \(0, 1\]"),
                          ("tspd:depth=0", "tspd: depth=0 must be >= 1")):
        with pytest.raises(InputError, match=rf"^preset \S+p.yaml: decoder '{spec}': {message}$"):
            load_eval_preset(_write(tmp_path, GOOD.replace('"threshold:tau=0.9"', f'"{spec}"')))
    # decoders that do not fit the family are refused at load (they were only at run time)
    with pytest.raises(InputError, match=r"decoder 'ar' does not fit a block_causal diffusion model \(sdar\)"):
        load_eval_preset(_write(tmp_path, GOOD.replace('"threshold:tau=0.9"', '"ar"')))
    qwen = GOOD.replace("family: sdar", "family: qwen3").replace("mask_token_id: 3", "mask_token_id: null")
    with pytest.raises(InputError, match=r"decoder 'static' does not fit an autoregressive model \(qwen3\); use ar"):
        load_eval_preset(_write(tmp_path, qwen))
    # a bidirectional model's decoders name their block (block_size was documented as one, and not applied)
    llada = GOOD.replace("family: sdar", "family: llada").replace("block_size: 8", "block_size: 32")
    with pytest.raises(InputError, match=r"decoder 'static' names no block; .* add block=32"):
        load_eval_preset(_write(tmp_path, llada))
    load_eval_preset(_write(tmp_path, llada.replace("[static, \"threshold:tau=0.9\"]",
                                                    "[\"static:block=32\", \"threshold:tau=0.9,block=16\"]")))


def test_eval_runs_a_presets_table(tmp_path, capsys):
    """`dlmjax eval --preset FILE --model DIR`: the preset's tasks, lengths, batch and decoders."""
    from dlmjax.presets import resolve_model

    mask = load_config(resolve_model("random-sdar")).mask_token_id  # untrained, 2 layers, block 4
    preset = _write(tmp_path, GOOD.replace("mask_token_id: 3", f"mask_token_id: {mask}")
                    .replace("block_size: 8", "block_size: 4").replace('[static, "threshold:tau=0.9"]',
                                                                       '["threshold:tau=0.9"]'))
    code = cli_main(["eval", "--preset", str(preset), "--model", "random-sdar", "--limit", "2", "--out",
                     str(tmp_path / "out"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    records = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [(r["task"], r["decoder"], r["n"]) for r in records] == [("toy-arith", "threshold:tau=0.9", 2)]
    # the preset's generation length, 16 tokens, not toy-arith's 48: an untrained model commits ~1 per step
    assert all(r["nfe"] < 20 for r in records)
    # a preset for another model is refused before anything runs
    assert cli_main(["eval", "--preset", "llada-8b-instruct", "--model", "toy-sdar", "--out",
                     str(tmp_path / "x")]) == 2
    assert "for GSAI-ML/LLaDA-8B-Instruct (family llada)" in capsys.readouterr().err
    # a preset's chat: true is turned off by --no-chat (random-sdar has no chat template)
    chat = _write(tmp_path, preset.read_text().replace("chat: false", "chat: true"))
    common = ["eval", "--preset", str(chat), "--model", "random-sdar", "--limit", "1", "--no-progress"]
    assert cli_main([*common, "--out", str(tmp_path / "chat")]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert cli_main([*common, "--no-chat", "--out", str(tmp_path / "plain")]) == 0
    assert json.loads((tmp_path / "plain" / "results.json").read_text())["settings"]["chat"] is False
    # the drafter a preset names is named where the model has none
    assert cli_main(["eval", "--preset", "qwen3-8b", "--model", "random-qwen3", "--decoder", "drafter",
                     "--task", "gsm8k", "--limit", "1", "--out", str(tmp_path / "d")]) == 2
    assert "(the preset's drafter is z-lab/Qwen3-8B-DFlash-b16, from huggingface.co/z-lab" in capsys.readouterr().err


def test_published_mrp_checkpoints_config_keys_load_and_are_checked(tmp_path):
    """heavyball/sdar-*-mrp-3lyr write num_mrp_heads and num_nextn_predict_layers in config.json."""
    cfg = ModelConfig(family="sdar", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, attention="block_causal", block_size=16, qk_norm=True,
                      mask_token_id=60)
    out = export_model(init_model(cfg, seed=0), tmp_path / "mrp")
    save_head(init_head(cfg, num_layers=3, seed=1), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_mrp_heads": 1, "num_nextn_predict_layers": 3}))
    assert load_config(out).block_size == 16
    assert len(load_head(out).mrp_modules[0].layers) == 3
    (out / "config.json").write_text(json.dumps({**config, "num_mrp_heads": 1, "num_nextn_predict_layers": 2}))
    with pytest.raises(Exception, match="num_nextn_predict_layers=2 but its mrp_modules"):
        load_head(out)


def test_chat_template_variables_reach_the_template():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and " \
               "not enable_thinking %}<think></think>{% endif %}"
    tok = Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), None, None, None, None, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "hi"
    assert tok.apply_chat_template(messages, enable_thinking=False) == "hi<think></think>"


def test_the_psd_and_tspd_seeds_llada_moe_table_decodes_a_llada_moe_model(tmp_path, monkeypatch):
    """Every decoder of the llada-moe-7b-a1b-instruct preset runs on a (tiny, random) LLaDA-MoE model
    at the preset's block; PSD and CE verify drafts, so they give the tokens of their policies."""
    from dlmjax.decoding.api import generate
    from dlmjax.presets import load_checkpoint

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    _, model, tokenizer, _ = load_checkpoint("random-llada-moe")
    preset = load_eval_preset("llada-moe-7b-a1b-instruct")
    tokens = {spec: generate(model, ["ab", "c"], tokenizer=tokenizer, decoder=spec, max_new_tokens=preset.block_size)
              for spec in preset.decoders}
    assert all(len(row.tokens) == preset.block_size for result in tokens.values() for row in result.rows)
    threshold = [row.tokens for row in tokens["threshold:tau=0.9,block=32"].rows]
    assert [row.tokens for row in tokens["psd:policy=threshold,tau=0.9,depth=4,block=32"].rows] == threshold


def test_a_preset_file_with_a_yaml_syntax_error_is_one_line_naming_where(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("name: mine\ndecoders: [static\n")
    with pytest.raises(InputError) as err:
        load_eval_preset(bad)
    assert f"{bad}: YAML syntax error: line 3, column 1: " in str(err.value) and "\n" not in str(err.value)
