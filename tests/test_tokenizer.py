"""Tokenizer loading from a checkpoint directory: special ids per family and chat templates."""

import json

import pytest

from dlmjax.config import ModelConfig
from dlmjax.io.tokenizer import TokenizerError, load_tokenizer
from dlmjax.toy.tokenizer import EOS, MASK, PAD, char_tokenizer, save_char_tokenizer


def config(family, mask=None):
    return ModelConfig(family=family, vocab_size=104, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=4, mask_token_id=mask,
                       attention="block_causal" if family == "sdar" else "causal",
                       block_size=4 if family == "sdar" else None)


def test_char_tokenizer_roundtrip(tmp_path):
    ids = save_char_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "12+30=42\n#### 42"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)
    assert (tok.mask_id, tok.eos_id, tok.pad_id) == (ids["mask"], ids["eos"], ids["pad"])
    assert tok.decode([ids["mask"], *tok.encode("ab"), ids["eos"]]) == "ab"


@pytest.mark.parametrize("model", ["toy-ar", "toy-sdar"])
def test_the_toy_tokenizer_encodes_in_transformers_as_in_dlmjax(model, tmp_path):
    """transformers' AutoTokenizer on the shipped toy checkpoints (and their exports) reads the
    character vocabulary as dlmjax does; without `tokenizer_class` it took Qwen2's class from the
    model type and dropped the newline."""
    transformers = pytest.importorskip("transformers")
    from dlmjax.presets import resolve_model

    text = "12+7-3\n#### 16"
    path = resolve_model(model)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))(text, add_special_tokens=False)["input_ids"]
    assert theirs == load_tokenizer(path).encode(text) and len(theirs) == len(text)
    save_char_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_mask_id_from_config_wins(tmp_path):
    save_char_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, config("sdar", mask=7)).mask_id == 7


def test_family_mask_string_is_found(tmp_path):
    tok = char_tokenizer()
    tok.add_special_tokens(["<|MASK|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    loaded = load_tokenizer(tmp_path, config("sdar"))
    assert loaded.mask_id == tok.token_to_id("<|MASK|>")
    assert loaded.pad_id == loaded.eos_id == tok.token_to_id(EOS)  # pad falls back to eos


def test_missing_mask_is_a_clear_error(tmp_path):
    char_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, config("qwen3"))
    assert tok.mask_id is None
    with pytest.raises(TokenizerError, match="no mask token"):
        tok.require_mask()


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        load_tokenizer(tmp_path)


def test_chat_template(tmp_path):
    save_char_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == f"<user>hi{EOS}<assistant>"
    assert PAD != EOS != MASK


def test_generation_config_stop_ids_end_a_chat_turn(tmp_path):
    """Qwen-based chat checkpoints (SDAR-Chat) name <|endoftext|> in config.json and their turn's
    end <|im_end|> in generation_config.json: decoding stops at either, as transformers' generate()
    and SDAR's evaluation do. Here toy-sdar's config keeps its EOS and generation_config.json adds
    the newline token, which every toy-arith answer holds: rows then end at their first newline."""
    import shutil

    import dlmjax
    from dlmjax.decoding.api import generate
    from dlmjax.presets import resolve_model

    model_dir = tmp_path / "toy-sdar"
    shutil.copytree(resolve_model("toy-sdar"), model_dir)
    model = dlmjax.load_model(model_dir)
    newline = load_tokenizer(model_dir, model.config).encode("\n")[0]
    prompts = ["14+2+2\n", "3+17-2\n"]
    plain = generate(model, prompts, tokenizer=load_tokenizer(model_dir, model.config), max_new_tokens=24)
    assert all(newline in row.tokens[:-1] for row in plain.rows)  # they go on past a newline
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [newline, 5]}))
    tok = load_tokenizer(model_dir, model.config)
    assert tok.stop_ids == (newline, 5, tok.eos_id)
    stopped = generate(model, prompts, tokenizer=tok, max_new_tokens=24)
    for row, full in zip(stopped.rows, plain.rows):
        cut = full.tokens.index(newline) + 1
        assert row.tokens == full.tokens[:cut]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "\n"}))
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        load_tokenizer(model_dir, model.config)


# ------------------------------------------------------------------- chat templates as transformers renders them

CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA_LIKE = (
    "{{ bos_token }}{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '<|eot_id|>' }}"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{% endgeneration %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def chat_checkpoint(path, template, specials, token_config, bos_post=None):
    """A tiny BPE tokenizer with `specials`, a chat template and (`bos_post`) a post-processor
    that adds BOS, as Llama 3's does."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, processors, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 7 * 6? Hello world, the answer is 42. Zürich"] * 5, trainer)
    if bos_post:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos_post} $A",
                                                           special_tokens=[(bos_post, tok.token_to_id(bos_post))])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({**token_config, "tokenizer_class": "PreTrainedTokenizerFast",
                                                            "chat_template": template}))
    return path


@pytest.fixture
def chat_pair(tmp_path):
    transformers = pytest.importorskip("transformers")

    def make(kind, template=None):
        if kind == "llama":
            path = chat_checkpoint(tmp_path / "llama", template or LLAMA_LIKE,
                                   ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
                                   {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                                   bos_post="<|begin_of_text|>")
        else:
            path = chat_checkpoint(tmp_path / f"chatml{len(list(tmp_path.iterdir()))}", template or CHATML,
                                   ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                   {"bos_token": None, "eos_token": "<|im_end|>"})
        return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path))

    return make


def test_chat_templates_render_as_transformers_renders_them(chat_pair):
    """Llama-3-style: bos_token, strftime_now (today's date), loop controls, {% generation %};
    ChatML with tools through tojson (keys in order, non-ASCII kept, no HTML escaping); and a
    prompt's ids: BOS from the tokenizer's post-processor for plain text, not a second one after
    a template wrote it (`tokenizer(text)` in transformers would add a second; its
    apply_chat_template(tokenize=True) does not)."""
    messages = [{"role": "user", "content": "What is 7 * 6?"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "weather", "description": "it's <Zürich> & more",
                                               "parameters": {"b": 1, "a": 2}}}]
    for kind, extra in (("llama", {}), ("chatml", {"tools": tools})):
        ours, theirs = chat_pair(kind)
        text = ours.apply_chat_template(messages, **extra)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **extra)
        assert ours.encode_prompt(text) == list(ids)  # one BOS (Llama: the template's), none (ChatML)
        assert ours.encode_prompt("What is 7 * 6?") == theirs("What is 7 * 6?")["input_ids"]
    assert "Zürich" in text and '"b": 1, "a": 2' in text


def test_training_rows_render_the_templates_date_as_a_fixed_day(chat_pair):
    """A template that writes today's date (Llama 3.1's strftime_now) writes training rows at
    TRAINING_DATE, so a run resumed on another day reads the same rows (how many fit seq_len, and
    so every epoch's order, could change with the date); inference keeps today's date, as
    transformers writes it."""
    from dlmjax.io.tokenizer import TRAINING_DATE

    ours, theirs = chat_pair("llama")
    user = [{"role": "user", "content": "What is 7 * 6?"}]
    prompt, answer = ours.chat_row("What is 7 * 6?", "42")
    assert prompt == theirs.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                                date_string=f"{TRAINING_DATE:%d %b %Y}")
    assert answer == "42<|eot_id|>"  # the assistant turn up to its stop token (the EOS here)
    assert ours.apply_chat_template(user) == theirs.apply_chat_template(user, tokenize=False,
                                                                          add_generation_prompt=True)
    assert f"{TRAINING_DATE:%d %b %Y}" not in ours.apply_chat_template(user)  # today's date


def test_a_chat_template_cannot_reach_python(chat_pair):
    """Templates come with downloaded checkpoints: they run in Jinja's sandbox, as in transformers."""
    from dlmjax.io.tokenizer import TokenizerError

    ours, _ = chat_pair("chatml", "{{ cycler.__init__.__globals__.os.getpid() }}")
    with pytest.raises(TokenizerError, match="chat template error"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("prefix", ["Here is the code:\n```python\n", "The answer is"])
def test_continue_final_message_ends_inside_the_assistant_turn(chat_pair, prefix):
    """lm-eval's gen_prefix tasks render with add_generation_prompt=False; its HF model continues
    the last (assistant) message, as `continue_final_message` does in transformers."""
    messages = [{"role": "user", "content": "Write f."}, {"role": "assistant", "content": prefix}]
    for kind in ("chatml", "llama"):
        ours, theirs = chat_pair(kind)
        want = theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == want
        assert want.rstrip().endswith(prefix.rstrip())


def test_special_tokens_from_special_tokens_map_json(chat_pair, tmp_path):
    """Older checkpoints name their special tokens in special_tokens_map.json only (transformers
    reads them there): the template's bos_token and the BOS rule see them."""
    ours, theirs = chat_pair("llama")
    path = tmp_path / "llama"
    config = json.loads((path / "tokenizer_config.json").read_text())
    tokens = {"bos_token": config.pop("bos_token"), "eos_token": {"content": config.pop("eos_token"), "lstrip": False}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps(tokens))
    again = load_tokenizer(path)
    assert (again.bos_id, again.eos_id) == (ours.bos_id, ours.eos_id) and again.bos_id is not None
    messages = [{"role": "user", "content": "Hello"}]
    assert again.apply_chat_template(messages, date_string="1 Jan 2026").startswith("<|begin_of_text|>")
    assert again.apply_chat_template(messages, date_string="1 Jan 2026") == ours.apply_chat_template(
        messages, date_string="1 Jan 2026")


@pytest.mark.parametrize("declared_in", ["added_tokens.json", "added_tokens_decoder"])
def test_tokens_declared_beside_tokenizer_json_are_added_as_transformers_adds_them(tmp_path, declared_in):
    """The usual hand edit, a mask token added in added_tokens.json or tokenizer_config.json's
    added_tokens_decoder but not in tokenizer.json: transformers adds it, so dlmjax does too (it
    used to encode it as characters and find no mask)."""
    transformers = pytest.importorskip("transformers")
    save_char_tokenizer(tmp_path)
    size = load_tokenizer(tmp_path).vocab_size
    token_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if declared_in == "added_tokens.json":
        (tmp_path / "added_tokens.json").write_text(json.dumps({"<|new_mask|>": size}))
    else:
        token_config["added_tokens_decoder"] = {
            **token_config.get("added_tokens_decoder", {}),
            str(size): {"content": "<|new_mask|>", "special": True, "lstrip": False, "rstrip": False,
                        "normalized": False, "single_word": False}}
    token_config["mask_token"] = "<|new_mask|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(token_config))
    ours = load_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "1+<|new_mask|>=3"
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.mask_id == size and ours.vocab_size == len(theirs) == size + 1
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|new_mask|>": size, "<|other|>": size + 5}))
    with pytest.warns(UserWarning, match=r"'<\|other\|>' is declared with id .*left out; re-save the tokenizer"):
        assert load_tokenizer(tmp_path).vocab_size == size + 1  # the one that fits is still added


def test_a_special_flag_declared_in_tokenizer_config_wins_as_in_transformers(tmp_path):
    """tokenizer.json holds the mask as an ordinary added token, tokenizer_config.json declares it
    special: transformers takes the config's flag, so decoded text drops it (it showed `<|MASK|>`)."""
    transformers = pytest.importorskip("transformers")
    tok = char_tokenizer()
    tok.add_tokens(["<|MASK|>"])  # not special in tokenizer.json
    tok.save(str(tmp_path / "tokenizer.json"))
    mask = tok.token_to_id("<|MASK|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": EOS, "mask_token": "<|MASK|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(mask): {"content": "<|MASK|>", "special": True, "lstrip": False,
                                             "rstrip": False, "normalized": False, "single_word": False}}}))
    ours, theirs = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [*ours.encode("ab"), mask, *ours.encode("c")]
    assert ours.mask_id == mask and ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "abc"


def test_a_vocabulary_token_declared_special_in_tokenizer_config_is_special_as_in_transformers(tmp_path):
    """A token of the model's own vocabulary (not an added token in tokenizer.json) that
    tokenizer_config.json declares special: transformers makes it special on its id, so decoded
    text drops it; dlmjax kept it as text."""
    transformers = pytest.importorskip("transformers")
    tok = char_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    x = tok.token_to_id("x")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(x): {"content": "x", "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}}}))
    ours, theirs = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ours.encode("axb")
    assert ids == theirs("axb", add_special_tokens=False)["input_ids"] and x in ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_templates_see_every_special_token_as_transformers_passes_them(chat_pair, tmp_path):
    template = "{{ messages[0]['content'] }}[mask={{ mask_token }}][sep={{ sep_token }}][bos={{ bos_token }}]"
    path = chat_checkpoint(tmp_path / "vars", template, ["<|endoftext|>", "<|MASK|>", "<|sep|>"],
                           {"eos_token": "<|endoftext|>", "mask_token": "<|MASK|>", "sep_token": "<|sep|>",
                            "bos_token": None})
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "hi"}]
    want = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(messages, tokenize=False)
    assert load_tokenizer(path).apply_chat_template(messages, add_generation_prompt=False) == want
    assert want == "hi[mask=<|MASK|>][sep=<|sep|>][bos=]"  # an unset token renders empty


def test_a_git_lfs_pointer_is_named_with_the_fix(tmp_path):
    from dlmjax.io.safetensors import CheckpointError, SafetensorsFile

    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 11422654\n"
    (tmp_path / "tokenizer.json").write_text(pointer)
    (tmp_path / "model.safetensors").write_text(pointer)
    with pytest.raises(TokenizerError, match="tokenizer.json is a Git LFS pointer, not the file: .* `git lfs pull`"):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors is a Git LFS pointer, not the file"):
        SafetensorsFile(tmp_path / "model.safetensors")
