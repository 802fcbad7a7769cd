"""`DlmjaxLM`: a dlmjax model as an lm-evaluation-harness model (registered as `dlmjax`).

    lm_eval.simple_evaluate(model="dlmjax", model_args="pretrained=toy-sdar,decoder=threshold:tau=0.9", ...)

- `generate_until`: the requests of one task run as one continuous-batching `Stream` (the engine
  `dlmjax eval` uses), split over the mesh's 'data' axis. Outputs are cut as lm-eval cuts them:
  at `max_gen_toks` tokens, then at the first stop string of `until` (the EOS string added). A
  block decoder's row stops at a block boundary once its text settles that cut (`cut_is_settled`).
- `loglikelihood` / `loglikelihood_rolling`: exact for causal models; for diffusion models the
  masked-diffusion Monte Carlo bound (`dlmjax.lm_eval.likelihood`).
- Decoding metrics per task (NFE, TPF, tokens/s, accepted length) are kept and reported by
  `get_model_info` (lm-eval puts them in the results JSON under `config.decoding_metrics`).

model_args (`--model_args key=value,...` or a JSON object): see `MODEL_ARGS`. Commas separate
model_args, so a decoder with several options writes them with `;`
(`decoder=psd:policy=threshold;tau=0.9;depth=4`) or passes model_args as JSON.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import jax
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from dlmjax.decoding.api import Stream, _block_size, _round_up, mask_token_id
from dlmjax.decoding.spec import CAUSAL_DECODERS, DrafterDecoding, decoder_spec, parse_decoder
from dlmjax.io.tokenizer import TokenizerError
from dlmjax.lm_eval.likelihood import causal_logprobs, greedy_continuation, masked_diffusion_bound
from dlmjax.lm_eval.metrics import TaskMetrics
from dlmjax.models.moe import EXPERT_DISPATCH, dispatch_mismatch, set_expert_dispatch
from dlmjax.validation import InputError

log = logging.getLogger(__name__)

# key: (default, what it is)
MODEL_ARGS: dict[str, tuple[object, str]] = {
    "pretrained": (None, "checkpoint directory or preset (toy-sdar, toy-ar, ...); required"),
    "decoder": (None, "decoder SPEC as in `dlmjax generate` (options separated by ';'); default static, ar if causal, "
                      "fast-dllm-v2 for Fast-dLLM v2"),
    "max_new_tokens": (256, "generation budget when a request names no max_gen_toks"),
    "batch_size": (16, "decoding slots (continuous batching) and likelihood rows per forward"),
    "refill": (None, "rows started per refill forward (default batch_size/8)"),
    "mesh_data": (None, "devices on the mesh's 'data' axis (default: all devices / mesh_model)"),
    "mesh_model": (1, "devices on the mesh's 'model' axis (tensor parallel)"),
    "mesh_fsdp": (1, "devices on the mesh's 'fsdp' axis (each param's largest free dimension split over them)"),
    "mesh_expert": (1, "devices on the mesh's 'expert' axis (an MoE model's experts split over them)"),
    "expert_dispatch": ("auto", "how an MoE model's tokens meet experts split over 'expert': auto, all_to_all, "
                                "gather or xla (as `dlmjax eval --expert-dispatch`)"),
    "seed": (0, "sampling seed of sampled decoders and of the Monte Carlo masks"),
    "mc_num": (128, "Monte Carlo samples per diffusion log-likelihood"),
    "mc_batch": (32, "Monte Carlo samples per forward"),
    "is_check_greedy": (False, "diffusion log-likelihoods also check is_greedy by decoding the continuation one "
                               "token a forward (LLaDA's is_check_greedy; lambada's acc reads it): true or false"),
    "eos_suffix": (False, "diffusion log-likelihoods condition on an EOS after the continuation, never masked "
                          "(Dream's evaluation does): true or false"),
    "cfg": (0.0, "classifier-free guidance scale of diffusion log-likelihoods (LLaDA's `cfg`: u + (cfg+1)(c - u) "
                 "against the context masked; 0 = none); generation is not guided"),
    "dtype": (None, "float32, bfloat16 or float16 (default: the checkpoint's)"),
    "mrp_head": (None, "checkpoint directory holding the MRP head (default: the model's own)"),
    "drafter": (None, "DFlash drafter directory (default: the model's drafter/)"),
    "tspd_controller": (None, "TSPD controller (default: the model's own)"),
    "progress": (True, "dlmjax's progress bars (lm-eval's own stay): true or false"),
    "warmup": (True, "decode the first slots once untimed before each task (tokens/s excludes compilation)"),
    "add_bos_token": (None, "true: BOS alone as the contexts' special tokens (also where the tokenizer adds none: "
                            "SmolLM2), false: none (default: what the tokenizer adds, unless the text starts with "
                            "BOS; lm-eval's HF model's rule)"),
    "enable_thinking": (None, "chat template variable (Qwen3: false turns thinking off), as lm-eval's HF model takes it"),
    "max_batch_size": (None, "lm-eval's option; not used"),
    "device": (None, "lm-eval's option; not used (JAX places arrays on its devices)"),
}


class ModelArgsError(InputError):
    """model_args that dlmjax cannot use; the message names the fix."""


class RequestError(InputError):
    """A malformed lm-eval request; the message names the request and the fix."""


@dataclass
class GenerationRequest:
    index: int  # position in the request list (the sampling stream's row id)
    task: str
    context: str
    until: list[str]
    max_gen_toks: int
    sampling: bool = False  # what lm-eval's rule reads from gen_kwargs (do_sample, else temperature > 0)
    ignored: tuple[str, ...] = ()  # gen_kwargs dlmjax does not apply (its decoder spec says how to sample)


def check_model_args(args: dict) -> dict:
    """model_args with defaults filled in; an unknown key or a missing `pretrained` is an error."""
    unknown = sorted(set(args) - set(MODEL_ARGS))
    if unknown:
        hint = ""
        if "decoder" in args and any(k in str(args["decoder"]) or "=" not in k for k in unknown):
            hint = (" (decoder options inside model_args are separated by ';', e.g. "
                    "decoder=psd:policy=threshold;tau=0.9, because ',' separates model_args)")
        raise ModelArgsError(f"model_args key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"unknown{hint}; accepted: {', '.join(MODEL_ARGS)}")
    if args.get("pretrained") in (None, ""):
        raise ModelArgsError("model_args needs pretrained=DIR_OR_PRESET (a checkpoint directory or a preset such as "
                             "toy-sdar)")
    return {key: args.get(key, default) for key, (default, _) in MODEL_ARGS.items()}


def _int_arg(args: dict, key: str, *, minimum: int = 1) -> int | None:
    value = args[key]
    if value is None:
        return None
    if isinstance(value, bool):  # lm-eval's CLI turns "true" into True, which int() would take as 1
        raise ModelArgsError(f"model_args {key}={value!r} must be an integer >= {minimum}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ModelArgsError(f"model_args {key}={value!r} must be an integer >= {minimum}") from None
    if number < minimum or number != float(value):
        raise ModelArgsError(f"model_args {key}={value!r} must be an integer >= {minimum}")
    return number


def _guidance_arg(args: dict) -> float:
    try:
        cfg = float(args["cfg"])
    except (TypeError, ValueError):
        cfg = -1.0
    if not cfg >= 0:  # also NaN
        raise ModelArgsError(f"model_args cfg={args['cfg']!r} must be a number >= 0 (0: no guidance; LLaDA's "
                             "evaluation uses 0.5 to 2 on some multiple-choice tasks)")
    return cfg


def _bool_arg(args: dict, key: str) -> bool:
    value = args[key]
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
        return str(value).lower() in ("true", "1", "yes")
    raise ModelArgsError(f"model_args {key}={value!r} must be true or false")


def finish_text(tokens: list[int], tokenizer, until: list[str]) -> str:
    """A response as lm-eval's own models give it: the generated tokens cut at the first stop
    string (lm-eval's `postprocess_generated_text`), then without special tokens, and cut again
    there. The first cut reads the text with its special tokens, so a stop string such as
    `<|im_end|>` cuts too (LLaDA's evaluation decodes so; lm-eval's HF model stops at such a string
    while generating); the second, as lm-eval's HF model cuts, the text without them, where a stop
    string can span a special token left out. (The text the first cut keeps fixes the second, so a
    row stopped once its first cut settles (`cut_is_settled`) keeps its response.)"""
    text = postprocess_generated_text(tokenizer.decode(tokens, skip_special_tokens=False), until, None)
    return postprocess_generated_text(tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True), until, None)


# the last characters of a decoded prefix can change with the tokens after it: an unfinished
# character (U+FFFD), a space that tokenization cleanup drops before punctuation
_UNSETTLED_TAIL = 4


def cut_is_settled(prefix: str, until: list[str]) -> bool:
    """Whether the text of a row's first tokens fixes its stop-string cut: `finish_text` cuts the
    whole text where it cuts `prefix`, whatever follows. lm-eval splits at each stop string in
    turn, so a later string can cut inside an earlier one's occurrence (until ["Answer: ", ":"]).
    The prefix and the whole text agree up to E (the prefix's length less `_UNSETTLED_TAIL`).
    At each split either the cut falls where both agree, and from then on both texts are the
    same, or both cuts lie past E - (that string's length); so a cut at most E - (the strings'
    total length) was made where both agree (property-tested)."""
    terms = [term for term in until if term]
    if not terms:
        return False
    # a run of byte tokens that ends mid-character decodes to one U+FFFD per byte (byte-fallback
    # tokenizers): all of them may change, however many, before the margin
    prefix = prefix.rstrip("\ufffd")
    cut = len(postprocess_generated_text(prefix, terms, None))
    return cut <= len(prefix) - _UNSETTLED_TAIL - sum(map(len, terms))


def parse_generation_request(index: int, request, default_max: int) -> GenerationRequest:
    """The context, stop strings and budget of one generate_until request; a malformed one is an
    error naming the request."""
    where = f"generate_until request {index} (task {request.task_name}, doc {request.doc_id})"
    context, gen_kwargs = request.args
    if not isinstance(context, str) or not context:
        raise RequestError(f"{where}: the context is {'empty' if context == '' else repr(context)}; generation needs "
                           "a non-empty prompt string (check the task's doc_to_text)")
    if not isinstance(gen_kwargs, dict):
        raise RequestError(f"{where}: generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
    until = gen_kwargs.get("until")
    until = [] if until is None else [until] if isinstance(until, str) else until  # as lm-eval's own models
    if not isinstance(until, list) or not all(isinstance(s, str) for s in until):
        raise RequestError(f"{where}: `until` must be a list of stop strings (e.g. until: [\"\\n\\n\"]), got "
                           f"{until!r}")
    # lm-eval's aliases, in its order; one set to None counts as absent (lm-eval's normalize_gen_kwargs)
    budget = next((gen_kwargs[k] for k in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
                   if gen_kwargs.get(k) is not None), default_max)
    if isinstance(budget, float) and budget.is_integer():  # lm-eval's own models take int() of it
        budget = int(budget)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise RequestError(f"{where}: max_gen_toks={budget!r} must be a positive integer")
    try:
        temperature = float(gen_kwargs.get("temperature") or 0.0)
    except (TypeError, ValueError):
        raise RequestError(f"{where}: temperature={gen_kwargs['temperature']!r} must be a number") from None
    do_sample = gen_kwargs.get("do_sample")
    sampling = bool(do_sample) if do_sample is not None else temperature > 0  # lm-eval's normalize_gen_kwargs
    ignored = tuple(sorted(k for k, v in gen_kwargs.items() if v is not None and k not in _APPLIED_GEN_KWARGS))
    return GenerationRequest(index, str(request.task_name), context, list(until), budget, sampling, ignored)


# gen_kwargs dlmjax applies (the budget's aliases, stop strings) or reads (sampling, whose how is
# the decoder spec's); the others (top_p, top_k, repetition_penalty, ...) are named, once per task
_APPLIED_GEN_KWARGS = {"until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens", "do_sample",
                       "temperature"}


def warn_unmet_generation_kwargs(requests: list[GenerationRequest], decoder_samples: bool, spec: str) -> None:
    """One warning per task whose gen_kwargs ask for what the decoder does not do: sampling from a
    greedy decoder (every repeat of a pass@k task alike) or greedy decoding from a sampling one,
    and the kwargs dlmjax does not apply."""
    by_task = defaultdict(list)
    for req in requests:
        by_task[req.task].append(req)
    for task, reqs in by_task.items():
        asks = {req.sampling for req in reqs}
        if asks != {decoder_samples}:
            wanted = "sampling (do_sample, or temperature > 0)" if True in asks else "greedy decoding"
            log.warning("task %s asks for %s; the decoder %s %s (dlmjax samples as its decoder spec says: set "
                        "temperature=T, top_p=P in model_args decoder=, or 0 for greedy)", task, wanted, spec,
                        "samples" if decoder_samples else "is greedy")
        ignored = sorted({name for req in reqs for name in req.ignored})
        if ignored:
            log.warning("task %s: gen_kwargs %s are not applied (the decoder spec says how to sample)", task,
                        ", ".join(ignored))


def sampling_ids(requests) -> list[int]:
    """Each request's sampling stream id (`row_ids`): a hash of its task, document and index in the
    document, and of its repeat number where lm-eval sends the same request several times (pass@k).
    It depends on the request alone, not on its place among the other tasks' requests of the run,
    so a task's samples are the same whichever tasks share the run."""
    seen = Counter()
    ids = []
    for request in requests:
        key = f"{request.task_name}/{request.doc_id}/{request.idx}"
        ids.append(zlib.crc32(f"{key}/{seen[key]}".encode()) & 0x7FFFFFFF)
        seen[key] += 1
    return ids


class DlmjaxLM(TemplateLM):
    """A dlmjax checkpoint and decoder as an lm-eval model (module docstring)."""

    def __init__(self, **model_args):
        super().__init__()
        from dlmjax.io.hf import load_model
        from dlmjax.io.tokenizer import load_tokenizer
        from dlmjax.presets import resolve_model
        from dlmjax.sharding import make_mesh

        args = check_model_args(model_args)
        self.args = args
        self.batch_size = self._batch_size(args["batch_size"])
        self.max_new_tokens = _int_arg(args, "max_new_tokens")
        self.mc_num, self.mc_batch = _int_arg(args, "mc_num"), _int_arg(args, "mc_batch")
        self.seed = _int_arg(args, "seed", minimum=0)
        self.cfg = _guidance_arg(args)
        self.eos_suffix = _bool_arg(args, "eos_suffix")
        self.is_check_greedy = _bool_arg(args, "is_check_greedy")
        self.refill = _int_arg(args, "refill")
        self.warmup = _bool_arg(args, "warmup")
        self.progress = _bool_arg(args, "progress")
        self.add_bos_token = None if args["add_bos_token"] is None else _bool_arg(args, "add_bos_token")
        self.template_vars = {} if args["enable_thinking"] is None else {
            "enable_thinking": _bool_arg(args, "enable_thinking")}
        self.mesh = make_mesh(model=_int_arg(args, "mesh_model"), data=_int_arg(args, "mesh_data"),
                              fsdp=_int_arg(args, "mesh_fsdp"), expert=_int_arg(args, "mesh_expert"))
        if self.batch_size % self.mesh.shape["data"]:  # as `dlmjax eval`'s Stream: outputs do not depend on it
            rounded = _round_up(self.batch_size, self.mesh.shape["data"])
            log.info("batch_size=%d rounded up to %d, a multiple of mesh_data=%d (each device decodes an equal "
                     "share)", self.batch_size, rounded, self.mesh.shape["data"])
            self.batch_size = rounded

        self.path = resolve_model(args["pretrained"], "model_args pretrained=")
        # what can be checked without the weights is, before they load (minutes for a large model)
        if args["decoder"] is not None:
            self._decoder_spec(args["decoder"])
        if args["expert_dispatch"] not in EXPERT_DISPATCH:
            raise ModelArgsError(f"model_args expert_dispatch={args['expert_dispatch']!r}: choose one of "
                                 f"{', '.join(EXPERT_DISPATCH)}")
        self.head_dir = resolve_model(args["mrp_head"], "model_args mrp_head=") if args["mrp_head"] else None
        self.model = load_model(self.path, dtype=args["dtype"], mesh=self.mesh)  # params placed on the mesh
        if why := dispatch_mismatch(args["expert_dispatch"], self.model.config, self.mesh, "mesh_expert=N"):
            raise ModelArgsError(f"model_args expert_dispatch={args['expert_dispatch']} would be ignored: {why}")
        set_expert_dispatch(self.model, args["expert_dispatch"])
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.path, self.model.config)
        self.causal = self.model.config.attention == "causal"
        if self.cfg and self.causal:
            raise ModelArgsError(f"model_args cfg={self.cfg} guides a diffusion model's log-likelihood against its "
                                 "context masked; a causal model has no mask token to do that with: drop cfg")
        if self.eos_suffix and self.causal:
            raise ModelArgsError("model_args eos_suffix=true conditions a diffusion model's log-likelihood on an EOS "
                                 "after the continuation; a causal model reads left to right and cannot: drop it")
        if self.eos_suffix and self.model.config.attention == "block_causal":
            raise ModelArgsError("model_args eos_suffix=true is Dream's convention for bidirectional models; a "
                                 "block-causal model's blocks see no later block, so the EOS would condition the score "
                                 "only where it falls in the continuation's last block: drop it")
        self.use_decoder(args["decoder"])

    def use_decoder(self, decoder: str | None) -> None:
        """Decode with `decoder` (a SPEC, options separated by ',' or ';'; None: the model's default
        as `dlmjax generate` takes it: static, ar if causal, fast-dllm-v2 for its family) from now
        on, loading the MRP head or drafter it needs; the decoding metrics start afresh.
        `dlmjax eval --backend lm-eval` runs several decoders on one loaded model so."""
        from dlmjax.cli import _drafter_for
        from dlmjax.decoding.api import check_decoder
        from dlmjax.evaluation.runner import default_decoders, replicate_on
        from dlmjax.heads.mrp import has_head, load_head

        args, model = self.args, self.model
        spec, parsed = self._decoder_spec(decoder or default_decoders(model)[0])
        if isinstance(parsed, CAUSAL_DECODERS) != self.causal:
            raise ModelArgsError(f"decoder={spec!r} does not fit this {model.config.attention} {model.config.family} "
                                 f"model; use {'ar or drafter' if self.causal else 'a diffusion decoder'}")
        head = None
        if getattr(parsed, "needs_head", False):
            head = load_head(self.head_dir or self.path, model.config)
        elif self.head_dir is not None and not has_head(self.head_dir):
            raise ModelArgsError(f"mrp_head={args['mrp_head']!r} holds no MRP head")
        drafter = _drafter_for(self.path, model, [spec], args["drafter"], args["dtype"])
        if not self.causal:  # the block's fit, cache and head: refused now, not after other decoders ran
            check_decoder(parsed, model, head)
        self.decoder = parsed
        self.head, self.drafter = (replicate_on(m, self.mesh) if self.mesh.size > 1 else m for m in (head, drafter))
        self.metrics: dict[str, TaskMetrics] = {}

    def _decoder_spec(self, decoder: str):
        """(spec, parsed decoder) of a decoder SPEC, options separated by ';' or ',', with the TSPD
        controller stored beside the model filled in where the spec names none."""
        from dlmjax.cli import _with_controller

        spec = str(decoder).replace(";", ",")
        spec = _with_controller([spec], self.args["pretrained"], self.path, self.args["tspd_controller"])[0]
        return spec, parse_decoder(spec)

    # ------------------------------------------------------------------ construction from lm-eval

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """model_args win over lm-eval's own options. Its CLI always passes --batch_size, 1 unless
        given: a batch size from there below 2 leaves dlmjax's default (16 decoding slots; the
        outputs do not depend on it)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "batch_size" in extra and "batch_size" not in arg_dict:
            size = extra["batch_size"]
            if isinstance(size, int) and size < 2:
                log.info("lm-eval's batch_size=%s: dlmjax decodes %d rows at a time (batch_size= in model_args "
                         "sets it)", size, MODEL_ARGS["batch_size"][0])
                del extra["batch_size"]
        return cls(**{**extra, **arg_dict})

    @staticmethod
    def _batch_size(value) -> int:
        if isinstance(value, str) and value.startswith("auto"):
            log.warning("batch_size=%s: dlmjax has no automatic batch size; using %d", value, MODEL_ARGS["batch_size"][0])
            return MODEL_ARGS["batch_size"][0]
        return _int_arg({"batch_size": value}, "batch_size")

    # ------------------------------------------------------------------ tokenizer and chat template

    @property
    def eot_token_id(self) -> int:
        eos = self.config.eos_token_ids[0] if self.config.eos_token_ids else self.tokenizer.eos_id
        if eos is None:
            raise ModelArgsError(f"{self.path} names no EOS token (config.json eos_token_id or tokenizer_config.json "
                                 "eos_token)")
        return int(eos)

    @property
    def prefix_token_id(self) -> int:
        """lm-eval's HF model's: the tokenizer's BOS, else its EOS (Qwen declares no BOS)."""
        if self.tokenizer.bos_id is not None:
            return self.tokenizer.bos_id
        return self.tokenizer.eos_id if self.tokenizer.eos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.config.max_position_embeddings

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """lm-eval's HF model's rule: `add_special_tokens` if given; else model_args add_bos_token
        if set, else the tokenizer's own special tokens; none when the text starts with the prefix
        token (BOS, else EOS). With add_bos_token set, HFLM's transformers tokenizer has its
        post-processor rebuilt: its special tokens are BOS alone (true, where the tokenizer names
        one) or none (false), whatever tokenizer.json's post-processor adds."""
        if add_special_tokens is None:
            prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = self.add_bos_token is not False and not string.startswith(prefix)
        if self.add_bos_token is None:
            return self.tokenizer.backend.encode(string, add_special_tokens=add_special_tokens).ids
        ids = self.tokenizer.encode(string)
        bos = self.tokenizer.bos_id
        return [bos, *ids] if add_special_tokens and self.add_bos_token and bos is not None else ids

    @property
    def tokenizer_name(self) -> str:
        return str(self.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As lm-eval's HF model: without a generation prompt (a task's gen_prefix is the last,
        assistant, message) the text ends inside the last message, continuing it; a template that
        refuses the system turn (Gemma's, Mistral's) is rendered again without it, with a warning."""
        def render(history):
            return self.tokenizer.apply_chat_template(history, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt,
                                                      **self.template_vars)

        try:
            return render(chat_history)
        except TokenizerError:
            if not any(m.get("role") == "system" for m in chat_history):
                raise
            log.warning("the chat template refuses a system turn: rendering without it (as lm-eval's HF model does)")
            return render([m for m in chat_history if m.get("role") != "system"])

    # ------------------------------------------------------------------ generate_until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if self.cfg:
            raise ModelArgsError(f"model_args cfg={self.cfg} guides log-likelihoods only; dlmjax's decoders do not "
                                 "guide generation (LLaDA's generation evaluations run at cfg 0): drop cfg for "
                                 "generation tasks")
        parsed = [parse_generation_request(i, r, self.max_new_tokens) for i, r in enumerate(requests)]
        warn_unmet_generation_kwargs(parsed, getattr(self.decoder, "temperature", 0.0) > 0, decoder_spec(self.decoder))
        streams = sampling_ids(requests)
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        groups = defaultdict(list)  # one stream per (task, budget)
        for req in parsed:
            groups[(req.task, req.max_gen_toks)].append(req)
        responses: list[str | None] = [None] * len(parsed)
        with tqdm(total=len(parsed), desc="dlmjax generate_until", disable=disable_tqdm or not self.progress) as bar:
            for (task, budget), group in groups.items():
                prompts = [self._prompt_ids(req.context, budget) for req in group]
                # the EOS string is cut last, from a cut text `until` has settled; the EOS token ends a row
                stops = [req.until for req in group]
                for req, row in zip(group, self._decode(task, prompts, budget, [streams[r.index] for r in group],
                                                        stops)):
                    responses[req.index] = finish_text(row.tokens, self.tokenizer, req.until + [eos])
                    self.cache_hook.add_partial("generate_until", requests[req.index].args, responses[req.index])
                    bar.update(1)
        return responses

    def _prompt_ids(self, context: str, budget: int) -> list[int]:
        """The context's ids, left-truncated (as lm-eval's HF model does) to leave room for `budget`."""
        ids = self.tok_encode(context)
        length, extra, why = self._decode_length(budget)
        room = length - budget - extra
        if room < 1:
            raise RequestError(f"max_gen_toks needs {budget} tokens{f' (+ {extra} for {why})' if extra else ''}"
                               f" but the model holds {length}; lower max_gen_toks (gen_kwargs) or max_new_tokens "
                               "(model_args); in `dlmjax eval --backend lm-eval`: --max-new-tokens")
        if len(ids) > room:
            log.warning("a context of %d tokens is left-truncated to %d (model length %d, budget %d)",
                        len(ids), room, length, budget)
            ids = ids[-room:]
        return ids

    def _decode_length(self, budget: int) -> tuple[int, int, str]:
        """(positions a decode may use, positions the decoder needs beyond prompt + `budget`, what
        needs them): a DFlash drafter also bounds the length and needs one block of room
        (decoding/speculative); a bidirectional model decodes whole blocks after the prompt."""
        if self.config.attention == "bidirectional":
            return self.max_length, _round_up(budget, _block_size(self.decoder, self.model)) - budget, "whole blocks"
        if self.drafter is None or not isinstance(self.decoder, DrafterDecoding):
            return self.max_length, 0, ""
        block = int(self.decoder.block or self.drafter.config.block_size)
        return min(self.max_length, self.drafter.config.max_position_embeddings), block, "the drafter block"

    def _decode(self, task: str, prompts: list[list[int]], budget: int, row_ids: list[int], stops: list[list[str]]):
        """Rows for `prompts` in order, from one continuous-batching stream; metrics recorded. A
        row ends at a block boundary once its text settles its cut at its `stops` strings."""

        def stop(index: int, tokens: list[int]) -> bool:
            return cut_is_settled(self.tokenizer.decode(tokens, skip_special_tokens=False), stops[index])

        def stream(limit=None):
            return Stream(self.model, prompts, batch_size=self.batch_size, refill=self.refill, tokenizer=self.tokenizer,
                          decoder=self.decoder, max_new_tokens=budget, seed=self.seed, row_ids=row_ids,
                          mesh=self.mesh if self.mesh.shape["data"] > 1 else None, head=self.head,
                          drafter=self.drafter, limit=limit,
                          stop=stop if any(map(any, stops)) else None)  # no stop string: no looks at the rows

        if self.warmup:  # compile outside the timed run, as `dlmjax eval` does
            probe = stream()
            warm = probe.batch if self.causal else probe.batch + probe.refill  # causal: batches of one shape
            for _ in stream(limit=min(len(prompts), warm)):
                pass
        run = stream()
        rows = dict(iter(run))
        ordered = [rows[i] for i in range(len(prompts))]
        self.metrics.setdefault(task, TaskMetrics(task)).add(run, ordered)
        return ordered

    # ------------------------------------------------------------------ log-likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, rolling: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) per (cache key, context ids, continuation ids); `rolling`
        windows of one document take no EOS suffix (the document goes on after them). An empty
        continuation scores (0.0, True), the log-likelihood of no tokens, as lm-eval's HF model
        scores it."""
        scored = [i for i, (_, _, cont) in enumerate(requests) if len(cont)]
        if len(scored) < len(requests):
            log.warning("%d loglikelihood requests have an empty continuation: each scores 0.0 (no tokens), "
                        "is_greedy True, as lm-eval's HF model scores them", len(requests) - len(scored))
        pairs = [self._fit(requests[i][1], requests[i][2], rolling=rolling) for i in scored]
        results = [(0.0, True)] * len(requests)
        for i, result in zip(scored, self._score_pairs(pairs, rolling, disable_tqdm)):
            results[i] = result
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def _score_pairs(self, pairs, rolling: bool, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each fitted (context, continuation) pair."""
        if not pairs:
            return []
        if self.causal:
            return causal_logprobs(self.model, pairs, batch_size=self.batch_size, pad_id=self.eot_token_id,
                                   prefix_id=self.prefix_token_id)
        suffix = [self.eot_token_id] if self.eos_suffix and not rolling else []
        mask_id = int(mask_token_id(self.config, self.tokenizer))
        check_greedy = self.is_check_greedy and not rolling  # a rolling window's is_greedy is never read
        if not self.is_check_greedy and not rolling:
            log.warning("is_greedy is False for every diffusion log-likelihood (model_args is_check_greedy=false, "
                        "as LLaDA's evaluation recommends); a metric that reads it (lambada's acc) needs "
                        "is_check_greedy=true")
        results = []
        for ctx, cont in tqdm(pairs, desc="dlmjax loglikelihood (Monte Carlo)", disable=disable_tqdm or not self.progress):
            value = masked_diffusion_bound(self.model, ctx, cont, mc_num=self.mc_num, seed=self.seed, mask_id=mask_id,
                                           batch_size=self.mc_batch, pad_id=self.eot_token_id, cfg=self.cfg,
                                           suffix=suffix)
            greedy = check_greedy and greedy_continuation(self.model, ctx, cont, mask_id=mask_id,
                                                          pad_id=self.eot_token_id, cfg=self.cfg)
            results.append((value, greedy))
        return results

    def _fit(self, context: list[int], continuation: list[int], rolling: bool = False) -> tuple[list[int], list[int]]:
        """(context, continuation) ids within the model's length: the context left-truncated; an
        empty context becomes the prefix token (BOS, else EOS), as lm-eval's `loglikelihood` and
        its HF model condition an unconditional continuation."""
        room = self._scored_length(rolling) + 1 - len(continuation)  # tokens left for the context
        if room < 1:
            raise RequestError(f"a continuation of {len(continuation)} tokens does not fit the model's length "
                               f"{self.max_length} with any context")
        context = list(context) or [self.prefix_token_id]
        if len(context) > room and not rolling:  # a rolling window's context is cut to fit by design
            log.warning("a context of %d tokens is left-truncated to %d to score a %d-token continuation (model "
                        "length %d)", len(context), room, len(continuation), self.max_length)
        return context[-room:], continuation

    def _scored_length(self, rolling: bool = False) -> int:
        """Most tokens one window scores: a causal model reads all but the last of context +
        continuation, a diffusion model reads them all (and an EOS suffix after them, where set:
        not after a rolling window)."""
        return self.max_length if self.causal else self.max_length - 1 - (self.eos_suffix and not rolling)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document scored in disjoint windows of the model's length, as lm-eval's HF model does;
        the windows of all documents are scored together, in batches (one document alone filled a
        batch with copies of its window)."""
        texts = [request.args[0] for request in requests]
        windows = [[make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
            max_seq_len=self._scored_length(rolling=True), context_len=1)] for text in texts]
        scores = iter(self._loglikelihood_tokens([(None, ctx, cont) for doc in windows for ctx, cont in doc],
                                                 disable_tqdm=disable_tqdm, rolling=True))
        results = []
        for text, doc in zip(texts, windows):
            total = sum(next(scores)[0] for _ in doc)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    # ------------------------------------------------------------------ reporting

    def get_model_info(self) -> dict:
        """What lm-eval stores in the results JSON's `config`: the model, its decoder and the
        decoding metrics of every task run so far."""
        from dlmjax.decoding.spec import decoder_spec
        from dlmjax.lm_eval.metrics import record_run

        info = {"dlmjax_model": str(self.path), "decoder": decoder_spec(self.decoder),
                "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                "decoding_metrics": {task: m.to_json() for task, m in self.metrics.items()}}
        record_run(info)
        return info
