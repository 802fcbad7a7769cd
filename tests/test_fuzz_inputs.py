"""Property-based tests (hypothesis) of every parser of user input: random and mutated decoder
specs, config.json dicts, YAML run configs and command lines give either a valid object or the
library's own error (`InputError`, with a message), never another exception. Bounded to run in
seconds: few examples each, no deadline (the first calls import and compile)."""

import copy
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

import dlmjax.decoding  # noqa: F401  (registers every decoder)
from dlmjax.cli import main, parse_args
from dlmjax.config import ModelConfig, from_hf_config
from dlmjax.decoding.spec import DECODERS, parse_decoder
from dlmjax.train.config import RunConfig, load_run_config
from dlmjax.validation import InputError

REPO = Path(__file__).resolve().parents[1]
BOUNDED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)


def expect_valid_or_input_error(build, valid_type):
    """`build()` returns a `valid_type` or raises the library's InputError with a message."""
    try:
        result = build()
    except InputError as err:
        assert str(err).strip(), "an InputError needs a message"
        return None
    assert isinstance(result, valid_type), type(result)
    return result


# -- decoder specs ------------------------------------------------------------------------------------

OPTION_NAMES = sorted({f for cls in DECODERS.values() for f in cls.__dataclass_fields__})
OPTION_VALUES = st.one_of(st.sampled_from(["0", "1", "-1", "0.5", "2", "1e9", "nan", "inf", "-inf", "true", "no",
                                           "threshold", "topk", "dual", "toy-sdar", "", "1_0", "0x10"]),
                          st.integers(-5, 50).map(str), st.floats(allow_nan=True).map(str),
                          st.text(alphabet=st.characters(blacklist_characters=",:"), max_size=8))


@st.composite
def decoder_specs(draw):
    name = draw(st.one_of(st.sampled_from(sorted(DECODERS)), st.text(max_size=8)))
    options = draw(st.lists(st.tuples(st.one_of(st.sampled_from(OPTION_NAMES), st.text(max_size=6)),
                                      st.sampled_from(["=", "", "=="]), OPTION_VALUES), max_size=4))
    body = ",".join(f"{key}{eq}{value}" for key, eq, value in options)
    return f"{name}:{body}" if body or draw(st.booleans()) else name


@BOUNDED
@given(decoder_specs())
def test_decoder_spec_parser(spec):
    decoder = expect_valid_or_input_error(lambda: parse_decoder(spec), object)
    if decoder is not None:
        assert type(decoder) in DECODERS.values()


@BOUNDED
@given(st.one_of(st.text(max_size=40), st.binary(max_size=20).map(lambda b: b.decode("latin-1")), JSON_VALUES))
def test_decoder_spec_parser_on_anything(spec):
    expect_valid_or_input_error(lambda: parse_decoder(spec), object)


# -- config.json translation --------------------------------------------------------------------------

BASES = [
    {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
     "hidden_act": "silu", "dtype": "float32", "eos_token_id": [1, 2]},
    {"model_type": "sdar", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
     "num_attention_heads": 4, "num_key_value_heads": 4, "block_size": 4, "rope_theta": 1e6, "mask_token_id": 3},
    {"model_type": "llada", "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 1, "mlp_hidden_size": 64,
     "vocab_size": 64, "embedding_size": 64, "activation_type": "silu", "block_type": "llama", "rope": True,
     "layer_norm_type": "rms", "weight_tying": False, "mask_token_id": 63},
]


@st.composite
def mutated_configs(draw):
    raw = copy.deepcopy(draw(st.sampled_from(BASES)))
    keys = sorted(raw)
    for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        raw[key] = draw(JSON_VALUES)
    for key in draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)):
        raw.pop(key, None)
    if draw(st.booleans()):
        raw[draw(st.sampled_from(["rope_scaling", "layer_types", "sliding_window", "attention_bias", "head_dim",
                                  "hidden_act", "dtype", "pad_token_id", "surprise"]))] = draw(JSON_VALUES)
    return raw


@BOUNDED
@given(mutated_configs())
def test_config_json_translation(raw):
    cfg = expect_valid_or_input_error(lambda: from_hf_config(raw), ModelConfig)
    if cfg is not None:
        assert cfg.vocab_size >= 1 and cfg.num_heads % cfg.num_kv_heads == 0


@BOUNDED
@given(JSON_VALUES)
def test_config_json_translation_on_anything(raw):
    expect_valid_or_input_error(lambda: from_hf_config(raw), ModelConfig)


# -- YAML run configs -----------------------------------------------------------------------------------

CONFIGS = sorted(REPO.glob("configs/**/*.yaml"))
SECTION_KEYS = ["objective", "backbone", "model", "data", "train", "mrp", "drafter", "tspd", "train.steps",
                "train.lr", "data.tasks", "data.seq_len", "mrp.loss", "drafter.block_size", "tspd.features",
                "model.block_size", "model.attention", "train.init_from", "nope.key", "train.nope"]


def _set(raw: dict, dotted: str, value) -> None:
    node = raw
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


@st.composite
def mutated_yaml(draw):
    source = draw(st.sampled_from(CONFIGS)).read_text()
    how = draw(st.sampled_from(["values", "text"]))
    if how == "values":  # a well-formed file with wrong keys or values
        raw = yaml.safe_load(source)
        for key in draw(st.lists(st.sampled_from(SECTION_KEYS), max_size=3)):
            _set(raw, key, draw(JSON_VALUES))
        return yaml.safe_dump(raw)
    at = draw(st.integers(0, len(source)))  # a damaged file
    cut = draw(st.integers(0, 20))
    return source[:at] + draw(st.sampled_from(["", ":", "- ", "\t", "{", "]", "  x: [", "\n  - 1", "'"])) + source[at + cut:]


OVERRIDES = st.lists(st.one_of(
    st.tuples(st.sampled_from(SECTION_KEYS), st.sampled_from(["=", ""]),
              st.one_of(st.sampled_from(["1", "-1", "0", "1e-3", "abc", "[", "{a: 1}", "null", "true", "[1, 2]"]),
                        st.text(max_size=6))).map("".join),
    st.text(max_size=12)), max_size=2)


@BOUNDED
@given(mutated_yaml(), OVERRIDES)
def test_yaml_loader(tmp_path_factory, text, overrides):
    path = tmp_path_factory.mktemp("yaml") / "run.yaml"
    path.write_text(text)
    try:
        run = load_run_config(path, overrides)
    except InputError as err:
        assert str(err).startswith(f"{path}: ") or str(err).startswith(f"{path} "), err  # names the file
        return
    assert isinstance(run, RunConfig)


# -- the command line ---------------------------------------------------------------------------------------

FLAGS = ["--model", "--prompt", "--decoder", "--max-new-tokens", "--limit", "--batch-size", "--task", "--out",
         "--data", "--seed", "--dtype", "--json", "--chat", "--strict-data", "--format", "--no-progress", "--help"]
WORDS = st.one_of(st.sampled_from(FLAGS), st.sampled_from(["0", "-5", "3", "1.5", "x", "", "threshold:tau=2",
                                                         "train.steps=1", "bfloat16", "torch"]),
                  st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                          max_size=6))


@BOUNDED
@given(st.sampled_from(["generate", "eval", "train", "export", "traces", "nope"]), st.lists(WORDS, max_size=6))
def test_cli_argument_parsing(capsys, command, words):
    """argparse exits 2 (usage) or 0 (--help), or returns arguments whose counts are all >= 1."""
    try:
        args = parse_args([command, *words])
    except SystemExit as exit_:
        assert exit_.code in (0, 2)
        return
    for count in ("max_new_tokens", "limit", "batch_size"):
        assert getattr(args, count, None) is None or getattr(args, count) >= 1


MISSING_MODEL = st.text(alphabet="abcdefghij/._-", min_size=1, max_size=12).map(lambda s: f"no-such-model-{s}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["generate", "eval", "export", "traces"]), MISSING_MODEL, st.lists(WORDS, max_size=3))
def test_cli_bad_model_is_one_line_exit_2(capsys, command, model, words):
    """Whatever else is on the line, a model that is no checkpoint or preset ends in one line with exit 2
    (or argparse's exit 2), never a traceback."""
    argv = {"generate": ["generate", "--model", model, "--prompt", "Hi"], "eval": ["eval", "--model", model],
            "export": ["export", model, "/nonexistent/out"], "traces": ["traces", "--model", model, "--out", "t"]}
    capsys.readouterr()  # the fixture is shared by the examples
    try:
        code = main([*argv[command], *[w for w in words if w not in ("--help", "--model")]])
    except SystemExit as exit_:
        assert exit_.code == 2
        return
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.startswith(f"dlmjax {command}: error: "), err

