"""The shipped toy-ar drafter (dlmjax/toy/checkpoints/toy-ar/drafter, a DFlash directory):
lossless greedy decoding at several batch and block sizes, acceptance equal to the PyTorch
reference's step by step, and an export that re-imports and decodes identically."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dlmjax.cli import main
from dlmjax.config import ConfigError
from dlmjax.decoding.ar import generate_ar
from dlmjax.decoding.speculative import generate_with_drafter
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.io.dflash import find_drafter_dir, load_drafter, resolve_drafter, save_drafter
from dlmjax.presets import load_checkpoint

MAX_NEW = 40


@pytest.fixture(scope="module")
def toy():
    model_dir, model, tokenizer, _ = load_checkpoint("toy-ar")
    drafter = resolve_drafter(model_dir, model.config)
    prompts = [tokenizer.encode(it.prompt) for t in ("toy-arith", "toy-constraint")
               for it in load_eval_set(t, limit=4).items]
    return model_dir, model, tokenizer, drafter, prompts


def _kw(tokenizer):
    return dict(max_new_tokens=MAX_NEW, eos_ids=(tokenizer.eos_id,), pad_id=0)


def test_shipped_beside_toy_ar(toy):
    model_dir, *_ = toy
    assert find_drafter_dir(model_dir) == model_dir / "drafter"


@pytest.mark.parametrize("batch, block", [(1, 8), (8, 8), (8, 4), (8, 16)])
def test_greedy_equals_ar_on_toy_ar(toy, batch, block):
    _, model, tokenizer, drafter, prompts = toy
    prompts = prompts[:batch]
    ar = generate_ar(model, prompts, **_kw(tokenizer))
    spec = generate_with_drafter(model, drafter, prompts, block=block, **_kw(tokenizer))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_generated), np.asarray(ar.num_generated))
    if batch == 8:
        assert len(set(np.asarray(ar.num_generated).tolist())) >= 3  # rows end (EOS) at different steps
    assert spec.mean_accepted_length > 2.0  # a trained drafter, not a random one


def test_accepted_lengths_match_pytorch_reference(toy):
    from transformers import AutoModelForCausalLM

    from drafter_reference import RefDrafter, speculative_greedy

    model_dir, model, tokenizer, drafter, prompts = toy
    rows = [prompts[0], prompts[5]]
    spec = generate_with_drafter(model, drafter, rows, **_kw(tokenizer))
    target = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    ref = RefDrafter.load(model_dir / "drafter")
    for i, prompt in enumerate(rows):
        tokens, steps = speculative_greedy(ref, target, prompt, MAX_NEW, drafter.config.block_size,
                                           eos_ids=(tokenizer.eos_id,))
        assert spec.accepted_lengths()[i] == steps
        assert np.asarray(spec.tokens)[i, : len(tokens)].tolist() == tokens
    assert max(max(r) for r in spec.accepted_lengths()) >= 4


@pytest.mark.parametrize("max_new", [3, MAX_NEW])
def test_accepted_lengths_add_up_to_the_tokens_output(toy, max_new):
    """A round counts the tokens it outputs, cut at EOS and at max_new_tokens (DFlash's
    acceptance_lengths): a row's rounds add up to its tokens after the prefill's first."""
    _, model, tokenizer, drafter, prompts = toy
    spec = generate_with_drafter(model, drafter, prompts, max_new_tokens=max_new, eos_ids=(tokenizer.eos_id,),
                                 pad_id=0)
    generated = np.asarray(spec.num_generated)
    assert [sum(r) for r in spec.accepted_lengths()] == (generated - 1).tolist()


@pytest.mark.parametrize("decoder", ["drafter:temperature=1.0", "ar:temperature=1.0"])
def test_a_sampled_row_does_not_depend_on_its_batch(toy, decoder):
    """`row_ids` keys each row's sampling stream for the causal decoders too: a prompt decoded
    alone with its id gives the tokens it gets in a batch, in a stream of small batches, and
    another seed gives other tokens."""
    from dlmjax.decoding.api import Stream, generate

    model_dir, model, tokenizer, drafter, prompts = toy
    prompts = prompts[2:8]  # both tasks
    kw = dict(tokenizer=tokenizer, decoder=decoder, max_new_tokens=24, drafter=drafter, seed=5)
    batch = [row.tokens for row in generate(model, prompts, **kw).rows]
    assert generate(model, [prompts[3]], row_ids=[3], **kw).rows[0].tokens == batch[3]
    streamed = dict(Stream(model, prompts, batch_size=4, **kw))
    assert [streamed[i].tokens for i in range(len(prompts))] == batch
    assert [row.tokens for row in generate(model, prompts, **{**kw, "seed": 6}).rows] != batch


def test_an_output_that_fits_the_context_decodes_up_to_its_end(toy):
    """prompt + max_new_tokens = max_position_embeddings (256) is what `ar` accepts; the drafter's
    last rounds verify drafts past the end and cut them, so it accepts it too and equals `ar`."""
    from dlmjax.validation import InputError

    _, model, tokenizer, drafter, prompts = toy
    prompt = prompts[0]
    max_new = model.config.max_position_embeddings - len(prompt)
    kw = dict(max_new_tokens=max_new, eos_ids=(), pad_id=0)
    spec = generate_with_drafter(model, drafter, [prompt], **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(generate_ar(model, [prompt], **kw).tokens))
    with pytest.raises(InputError, match="exceeds max_position_embeddings"):
        generate_with_drafter(model, drafter, [prompt], **{**kw, "max_new_tokens": max_new + 1})


def test_export_reimport_decodes_identically(toy, tmp_path):
    _, model, tokenizer, drafter, prompts = toy
    save_drafter(drafter, tmp_path / "again", dtype=None)
    again = load_drafter(tmp_path / "again", model.config)
    a = generate_with_drafter(model, drafter, prompts, **_kw(tokenizer))
    b = generate_with_drafter(model, again, prompts, **_kw(tokenizer))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.accepted), np.asarray(b.accepted))


@pytest.mark.devices(8)
def test_a_drafter_naming_its_mask_token_by_text_loads_with_its_target(toy, tmp_path):
    """An SGLang-style config (dflash_config.mask_token, no mask_token_id) takes the id from the
    target's tokenizer where it is loaded with its target; export writes the id out."""
    model_dir, model, _, drafter, _ = toy
    target = tmp_path / "toy-ar"
    shutil.copytree(model_dir, target)
    path = target / "drafter" / "config.json"
    raw = json.loads(path.read_text())
    del raw["dflash_config"]["mask_token_id"]
    raw["dflash_config"]["mask_token"] = "<|mask|>"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="load the drafter with its target"):
        load_drafter(target / "drafter")
    assert resolve_drafter(target, model.config).config.mask_token_id == drafter.config.mask_token_id == 2
    assert main(["export", str(target), str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())["dflash_config"]
    assert written == {**raw["dflash_config"], "mask_token_id": 2}


def test_data_parallel_batch_decodes_identically(toy):
    from dlmjax.sharding import make_mesh

    _, model, tokenizer, drafter, prompts = toy
    mesh = make_mesh(model=1)  # 8 fake CPU devices on 'data'
    plain = generate_with_drafter(model, drafter, prompts, **_kw(tokenizer))
    sharded = generate_with_drafter(model, drafter, prompts, mesh=mesh, **_kw(tokenizer))
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(sharded.accepted), np.asarray(plain.accepted))
