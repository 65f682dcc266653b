"""A memory plan before launch: what one device holds for a layout, from config.json alone.

    config = PlanConfig(world_size=8, tp=2, bf16=True, micro_batch_tokens=16384,
                        device_memory=parse_bytes("80GB"))
    plan = device_plan(hf_config, config)         # bytes by part, per device
    print(format_plan(plan))                       # the table, whether it fits, what to change

No process group, no model, no torch: the standard library and a config.json dict (MiMo /
Qwen2, DeepSeek-V3, GLM-4.5). Copy it alone.

What one device holds, in two phases of a colocated step:

    train     Megatron: weights, fp32 gradients (megatron DDP's main_grad buffers), fp32 main
              weights (bf16 models only) and Adam's m and v, the reference model (--kl-coef),
              and the activations of one micro-batch; vLLM asleep (nothing on the device).
    rollout   Megatron's weights, gradients and optimizer states stay; each vLLM engine takes
              --gpu-memory-utilization of the device: its weights, then KV cache in the rest.

The parameter counts are megatron-core's, tensor by tensor (`megatron_tensors`, the names
megatron-core 0.16.1's local spec gives them): tensor parallelism splits the column- and
row-parallel linears, the vocabulary of the embedding and output layer, and each expert's
width; it replicates norms, MoE routers and MLA's down projections. Expert parallelism
splits the routed experts. The MTP layers sit on the last pipeline stage. Weights, gradients
and the plain optimizer's states are exact (the suite compares them with a built model and
optimizer); the distributed optimizer's shards leave out megatron's bucket padding (at most
lcm(DP, 128) elements per bucket). Activations are an estimate (`activation_bytes`).
"""

import dataclasses
import math
import re

# Bytes per element.
FP32, BF16 = 4, 2
# Adam keeps m and v in fp32, and one fp32 step counter per tensor.
ADAM_STATES = 2
# The distributed optimizer's default: on where splitting the fp32 main weights and Adam
# states over the data-parallel ranks saves at least this much of a device's planned peak
# (a model of about 180M parameters at DP 2). Below it the split saves nothing that
# matters and still costs its reduce-scatter, all-gather and shard copies every step.
DISTRIBUTED_OPTIMIZER_MIN_SAVING = 2**30
# vLLM-CPU's KV cache block in tokens: 128, and 16 for MLA (its decode kernel's only size).
KV_BLOCK_TOKENS, MLA_KV_BLOCK_TOKENS = 128, 16
# The largest --tp the plan suggests: tensor parallelism all-reduces activations in every
# layer, which only a node's own links (NVLink, 8 devices) carry fast enough.
MAX_SUGGESTED_TP = 8
# --device-memory's units: decimal (GB) and binary (GiB).
BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """A layout and run, as the plan reads it. dp is what the world leaves after tp x cp x pp;
    the experts' data parallel size what it leaves after tp x ep x pp."""
    world_size: int = 1                  # processes in the job (nodes x devices per node)
    tp: int = 1                          # Megatron tensor, context, expert and pipeline parallel sizes
    cp: int = 1
    ep: int = 1
    pp: int = 1
    distributed_optimizer: bool = False  # ZeRO-1: main weights and Adam states split over data-parallel ranks
    bf16: bool = True                    # bf16 weights (fp32 main weights in the optimizer), bf16 rollout
    mtp_train: bool = True               # the model has its MTP layers, trained
    mtp_rollout: bool = True             # vLLM drafts with them: the trunk's final norm is frozen
    reference_model: bool = False        # --kl-coef > 0: a frozen copy of the trunk
    micro_batch_tokens: int = 8192       # tokens of one micro-batch on one data-parallel rank (over its CP ranks)
    rollout_tp: int = 1                  # vLLM tensor parallel size
    gpu_memory_utilization: float = 0.3  # each vLLM engine's share of the device
    device_memory: int = None            # bytes of one device; None: no verdict


def parse_bytes(text):
    """'80GB' -> 80e9, '141GB', '96GiB' -> 96 * 2**30, '1024' -> 1024; ValueError naming the text."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).upper()
    if not match or unit not in BYTE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r}: expected a positive size such as 80GB, 141GB or 96GiB (units: "
                         f"{', '.join(name for name in BYTE_UNITS if name)})")
    return int(float(match.group(1)) * BYTE_UNITS[unit])


def layout_problems(hf_config, config):
    """Each layout size that does not fit the world or the model, with what is expected."""
    c, problems = config, []
    for sizes, what in (((c.tp, c.cp, c.pp), "--tp x --cp x --pp"), ((c.tp, c.ep, c.pp), "--tp x --ep x --pp")):
        if c.world_size % math.prod(sizes):
            problems.append(f"{what} = {math.prod(sizes)}: expected a divisor of the world size {c.world_size}")
    heads = hf_config["num_attention_heads"]
    kv_heads = heads if "kv_lora_rank" in hf_config else hf_config.get("num_key_value_heads", heads)
    for flag, size in (("--tp", c.tp), ("--rollout-tp", c.rollout_tp)):
        if kv_heads % size:
            problems.append(f"{flag} {size}: expected a divisor of the model's {kv_heads} key/value heads")
    if c.world_size % c.rollout_tp:
        problems.append(f"--rollout-tp {c.rollout_tp}: expected a divisor of the world size {c.world_size}")
    if hf_config["vocab_size"] % c.tp:
        problems.append(f"--tp {c.tp}: expected a divisor of the vocabulary size {hf_config['vocab_size']}")
    if hf_config.get("n_routed_experts", 1) % c.ep:
        problems.append(f"--ep {c.ep}: expected a divisor of the {hf_config.get('n_routed_experts', 1)} routed experts")
    if hf_config["num_hidden_layers"] % c.pp:
        # megatron_model builds even stages only (flags refuses the run otherwise).
        problems.append(f"--pp {c.pp}: expected a divisor of the {hf_config['num_hidden_layers']} layers")
    return problems


# ---------------------------------------------------------------------------------------
# Parameters: megatron-core's tensors on one rank
# ---------------------------------------------------------------------------------------

def _attention_tensors(hf_config, tp):
    """name -> shape of one layer's attention on one TP rank (GQA with q/k/v bias, or MLA)."""
    h, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    if "kv_lora_rank" in hf_config:
        nope, rope, v = hf_config["qk_nope_head_dim"], hf_config["qk_rope_head_dim"], hf_config["v_head_dim"]
        q_rank, kv_rank = hf_config.get("q_lora_rank"), hf_config["kv_lora_rank"]
        query_width = heads * (nope + rope) // tp
        query = ({"linear_q_proj.weight": (query_width, h)} if not q_rank else
                 {"linear_q_down_proj.weight": (q_rank, h), "linear_q_up_proj.weight": (query_width, q_rank),
                  "q_layernorm.weight": (q_rank,)})
        return {"linear_proj.weight": (h, heads * v // tp), **query,
                "linear_kv_down_proj.weight": (kv_rank + rope, h),
                "linear_kv_up_proj.weight": (heads * (nope + v) // tp, kv_rank), "kv_layernorm.weight": (kv_rank,)}
    head_dim = hf_config.get("head_dim", h // heads)
    qkv = (heads + 2 * hf_config.get("num_key_value_heads", heads)) * head_dim // tp
    tensors = {"linear_proj.weight": (h, heads * head_dim // tp), "linear_qkv.weight": (qkv, h)}
    if hf_config["architectures"][0] == "MiMoForCausalLM" or hf_config.get("attention_bias"):
        tensors["linear_qkv.bias"] = (qkv,)
    if hf_config.get("use_qk_norm"):
        tensors.update({"q_layernorm.weight": (head_dim,), "k_layernorm.weight": (head_dim,)})
    return tensors


def is_moe_layer(hf_config, layer):
    """Whether layer `layer` (MTP layers count on from num_hidden_layers) has routed experts."""
    return "n_routed_experts" in hf_config and layer >= hf_config.get("first_k_dense_replace", 0)


def _mlp_tensors(hf_config, layer, tp, ep):
    """name -> shape of one layer's MLP on one rank: SwiGLU, or router, local experts, shared experts."""
    h = hf_config["hidden_size"]
    if not is_moe_layer(hf_config, layer):
        f = hf_config["intermediate_size"]
        return {"linear_fc1.weight": (2 * f // tp, h), "linear_fc2.weight": (h, f // tp)}
    experts, f = hf_config["n_routed_experts"], hf_config["moe_intermediate_size"]
    shared = f * hf_config.get("n_shared_experts", 0)
    tensors = {"router.weight": (experts, h)}
    for expert in range(experts // ep):
        tensors.update({f"experts.local_experts.{expert}.linear_fc1.weight": (2 * f // tp, h),
                        f"experts.local_experts.{expert}.linear_fc2.weight": (h, f // tp)})
    if shared:
        tensors.update({"shared_experts.linear_fc1.weight": (2 * shared // tp, h),
                        "shared_experts.linear_fc2.weight": (h, shared // tp)})
    return tensors


def _layer_tensors(hf_config, layer, tp, ep):
    h = hf_config["hidden_size"]
    tensors = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,)}
    tensors.update({f"self_attention.{name}": shape for name, shape in _attention_tensors(hf_config, tp).items()})
    tensors.update({f"mlp.{name}": shape for name, shape in _mlp_tensors(hf_config, layer, tp, ep).items()})
    return tensors


def stage_layers(hf_config, pp, stage):
    """The decoder layers of pipeline stage `stage` of `pp`: an even split (`pp` divides them)."""
    per_stage = hf_config["num_hidden_layers"] // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def megatron_tensors(hf_config, tp=1, ep=1, mtp=True, pp=1, stage=0):
    """name -> shape of every parameter megatron-core's GPTModel holds on one rank of
    pipeline stage `stage` (names as named_parameters gives them under megatron-core
    0.16.1's local spec; Transformer Engine's fuses the norms into the linears, same sizes).

    The first stage holds the embedding, the last the final norm, the output layer (unless
    tied on a single stage) and the MTP layers (which read the embedding: the last stage
    holds it too)."""
    h, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
    mtp_layers = hf_config.get("num_nextn_predict_layers", 0) if mtp else 0
    first, last = stage == 0, stage == pp - 1
    tensors = {"embedding.word_embeddings.weight": (vocab // tp, h)} if first or (last and mtp_layers) else {}
    layers = stage_layers(hf_config, pp, stage)
    for layer in layers:
        tensors.update({f"decoder.layers.{layer - layers.start}.{name}": shape
                        for name, shape in _layer_tensors(hf_config, layer, tp, ep).items()})
    if last:
        tensors["decoder.final_layernorm.weight"] = (h,)
        for j in range(mtp_layers):
            prefix = f"mtp.layers.{j}"
            tensors.update({f"{prefix}.enorm.weight": (h,), f"{prefix}.hnorm.weight": (h,),
                            f"{prefix}.eh_proj.weight": (h // tp, 2 * h), f"{prefix}.final_layernorm.weight": (h,)})
            layer = hf_config["num_hidden_layers"] + j
            tensors.update({f"{prefix}.transformer_layer.{name}": shape
                            for name, shape in _layer_tensors(hf_config, layer, tp, ep).items()})
        # Tied, the first stage's output layer is its embedding; a later stage keeps a copy.
        if not hf_config.get("tie_word_embeddings") or not first:
            tensors["output_layer.weight"] = (vocab // tp, h)
    return tensors


def is_expert(name):
    """Whether megatron keeps this parameter's gradients and optimizer states over the
    expert-data-parallel group (routed experts) rather than the data-parallel one."""
    return ".local_experts." in name


def trainable(name, config):
    """trainer.build_policy's rule: the trunk's final norm is frozen while vLLM drafts with a
    trained MTP head (Megatron's MTP layer reads the trunk after it, vLLM's before)."""
    return not (config.mtp_train and config.mtp_rollout and name == "decoder.final_layernorm.weight")


# ---------------------------------------------------------------------------------------
# Bytes per device
# ---------------------------------------------------------------------------------------

def data_parallel_sizes(config):
    """(the data x context parallel size dense states shard over, the expert-data-parallel size)."""
    c = config
    return c.world_size // (c.tp * c.pp), c.world_size // (c.tp * c.ep * c.pp)


def model_state_bytes(hf_config, config, stage=None):
    """Megatron's persistent bytes on one rank of pipeline stage `stage` (None: the last):
    {"weights", "gradients", "main_weights", "optimizer_states", "reference_weights"}.

    weights: every parameter in bf16 or fp32. gradients: fp32 for each trainable one
    (grad_reduce_in_fp32). main_weights: fp32 copies of the trainable bf16 weights.
    optimizer_states: Adam's m and v in fp32 plus a 4-byte step per tensor. With the
    distributed optimizer main weights and states are 1/(DP x CP) of the dense parameters'
    and 1/expert-DP of the experts' (megatron's bucket padding left out)."""
    c = config
    stage = c.pp - 1 if stage is None else stage
    tensors = megatron_tensors(hf_config, c.tp, c.ep, mtp=c.mtp_train, pp=c.pp, stage=stage)
    weight_bytes = BF16 if c.bf16 else FP32
    numel = {name: math.prod(shape) for name, shape in tensors.items()}
    train = [name for name in tensors if trainable(name, c)]
    dense_dp, expert_dp = data_parallel_sizes(c) if c.distributed_optimizer else (1, 1)
    share = {name: 1 / (expert_dp if is_expert(name) else dense_dp) for name in train}
    sharded = sum(numel[name] * share[name] for name in train)
    reference = megatron_tensors(hf_config, c.tp, c.ep, mtp=False, pp=c.pp, stage=stage) if c.reference_model else {}
    return {"weights": sum(numel.values()) * weight_bytes,
            "gradients": sum(numel[name] for name in train) * FP32,
            "main_weights": int(sharded * FP32) if c.bf16 else 0,
            # A step counter per tensor of this rank's shard: about its share of the tensors.
            "optimizer_states": int(sharded * ADAM_STATES * FP32) + math.ceil(sum(share.values())) * FP32,
            "reference_weights": sum(math.prod(shape) for shape in reference.values()) * weight_bytes}


def activation_elements_per_token(hf_config, layer, config):
    """Elements one token leaves saved for backward in decoder layer `layer` on one TP rank.

    Counted from what each op keeps: the two RMSNorms (input and output, 2h each), the
    q/k/v or MLA projections' inputs and outputs, flash attention's q, k, v, output and
    log-sum-exp, the output projection's input, SwiGLU's fc1 output (gate and up), its
    activation and product (5.5 f: measured on CPU, docs/SCALE.md). Sequence parallelism
    (MoE families at TP > 1) splits the hidden-size terms over TP as well. An MoE layer
    keeps this for each of a token's top-k experts, plus its router (fp32 scores)."""
    c, h, heads = config, hf_config["hidden_size"], hf_config["num_attention_heads"]
    sequence_parallel = "n_routed_experts" in hf_config and c.tp > 1
    hidden_terms = 6 * h / (c.tp if sequence_parallel else 1)
    if "kv_lora_rank" in hf_config:
        nope, rope, v = hf_config["qk_nope_head_dim"], hf_config["qk_rope_head_dim"], hf_config["v_head_dim"]
        latents = 3 * (hf_config.get("q_lora_rank") or 0) + 3 * hf_config["kv_lora_rank"] + rope
        attention = latents + heads * (3 * (nope + rope) + 4 * v + 1) / c.tp
    else:
        head_dim = hf_config.get("head_dim", h // heads)
        kv_heads = hf_config.get("num_key_value_heads", heads)
        attention = (heads * (3 * head_dim + 1) + 2 * kv_heads * head_dim) / c.tp
    if not is_moe_layer(hf_config, layer):
        return hidden_terms + attention + 5.5 * hf_config["intermediate_size"] / c.tp
    top_k, f = hf_config["num_experts_per_tok"], hf_config["moe_intermediate_size"]
    shared = f * hf_config.get("n_shared_experts", 0)
    # Each routed copy: its permuted input and output (2h) and the expert's SwiGLU; the
    # router's fp32 input and scores count twice in bf16 elements.
    routed = top_k * (2 * h + 5.5 * f / c.tp) + 2 * (h + 2 * hf_config["n_routed_experts"])
    return hidden_terms + attention + routed + 5.5 * shared / c.tp


def activation_bytes(hf_config, config, stage=0):
    """Activation bytes of pipeline stage `stage` on one rank: the micro-batch's tokens on
    this context-parallel rank times what each layer saves (`activation_elements_per_token`),
    the embedding's and MTP layers' own tensors (3h and 9h per token: norms, the MTP
    projection's input and output) and the fp32 logits: about 6.5 vocab/TP per token
    (log-softmax, entropy and cross entropy of the main and MTP heads, measured on CPU).
    Under 1F1B the first stage holds pp micro-batches in flight, the last one."""
    c, h = config, hf_config["hidden_size"]
    tokens = c.micro_batch_tokens / c.cp
    element = BF16 if c.bf16 else FP32
    layers = stage_layers(hf_config, c.pp, stage)
    per_token = sum(activation_elements_per_token(hf_config, layer, c) for layer in layers)
    in_flight = c.pp - stage
    if stage == c.pp - 1:
        mtp_layers = hf_config.get("num_nextn_predict_layers", 0) if c.mtp_train else 0
        per_token += 3 * h + mtp_layers * (9 * h + activation_elements_per_token(
            hf_config, hf_config["num_hidden_layers"], c))
        logits = tokens * 6.5 * hf_config["vocab_size"] / c.tp * FP32
        return int(tokens * per_token * element * in_flight + logits)
    return int(tokens * per_token * element * in_flight)


def kv_bytes_per_token(hf_config, config, drafting):
    """vLLM KV cache bytes per token of context in one engine on one rank: keys and values
    of this rank's KV heads per layer (the MTP layers too in a drafting engine); MLA caches
    one latent of kv_lora_rank + qk_rope_head_dim, whole on every rank."""
    layers = hf_config["num_hidden_layers"] + (hf_config.get("num_nextn_predict_layers", 0) if drafting else 0)
    if "kv_lora_rank" in hf_config:
        per_layer = hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"]
    else:
        heads = hf_config["num_attention_heads"]
        kv_heads = max(1, hf_config.get("num_key_value_heads", heads) // config.rollout_tp)
        per_layer = 2 * kv_heads * hf_config.get("head_dim", hf_config["hidden_size"] // heads)
    return layers * per_layer * (BF16 if config.bf16 else FP32)


def kv_cache_bytes(hf_config, config, drafting, context_tokens, sequences=1):
    """vLLM-CPU KV cache bytes for `sequences` requests of up to `context_tokens` tokens each,
    in one engine on one rank: vLLM holds each request's context in whole blocks, plus one
    block it keeps empty."""
    block = MLA_KV_BLOCK_TOKENS if "kv_lora_rank" in hf_config else KV_BLOCK_TOKENS
    return (sequences * -(-context_tokens // block) + 1) * block * kv_bytes_per_token(hf_config, config, drafting)


def rollout_engines(hf_config, config):
    """[(name, weight bytes, KV cache bytes, KV bytes per token)] of this device's vLLM
    engine, one whatever the drafting: a drafting one (with the MTP layers) or a plain one,
    given --gpu-memory-utilization of the device; its KV cache is what its weights leave of
    that (vLLM's own activations and CUDA graphs left out)."""
    c = config
    drafting = c.mtp_rollout and hf_config.get("num_nextn_predict_layers", 0) > 0
    kinds = [("drafting", True)] if drafting else [("plain", False)]
    engines = []
    for name, with_mtp in kinds:
        params = sum(math.prod(shape) for shape in megatron_tensors(hf_config, mtp=with_mtp).values())
        weights = params * (BF16 if c.bf16 else FP32) // c.rollout_tp
        share = int(c.gpu_memory_utilization * c.device_memory) if c.device_memory else 0
        engines.append((name, weights, max(0, share - weights), kv_bytes_per_token(hf_config, c, with_mtp)))
    return engines


def device_plan(hf_config, config):
    """The plan of the busiest pipeline stage: a dict of bytes per device ("weights",
    "gradients", "main_weights", "optimizer_states", "reference_weights", "activations",
    "train_phase", "rollout_phase", "total"), "engines" (`rollout_engines`), "stage",
    "parameters" (the whole model's), "dp", "expert_dp", and "fits" (None without
    device_memory). ValueError lists the layout's problems."""
    problems = layout_problems(hf_config, config)
    if problems:
        raise ValueError("the layout does not fit:\n  " + "\n  ".join(problems))
    engines = rollout_engines(hf_config, config)
    vllm = sum(int(config.gpu_memory_utilization * config.device_memory) if config.device_memory else weights
               for _, weights, _, _ in engines)
    stages = []
    for stage in range(config.pp):
        state = model_state_bytes(hf_config, config, stage)
        persistent = sum(state.values())
        activations = activation_bytes(hf_config, config, stage)
        stages.append(dict(state, stage=stage, activations=activations, train_phase=persistent + activations,
                           rollout_phase=persistent + vllm, total=max(persistent + activations, persistent + vllm)))
    plan = max(stages, key=lambda entry: entry["total"])
    dp, expert_dp = data_parallel_sizes(config)
    whole = megatron_tensors(hf_config, mtp=config.mtp_train)
    plan.update(engines=engines, dp=dp, expert_dp=expert_dp, config=config,
                parameters=sum(math.prod(shape) for shape in whole.values()),
                fits=None if config.device_memory is None else plan["total"] <= config.device_memory)
    return plan


def distributed_optimizer_pays(hf_config, config):
    """Whether the distributed optimizer saves at least DISTRIBUTED_OPTIMIZER_MIN_SAVING bytes of
    the device's planned peak (`device_plan` without and with it); True for a layout the
    plan cannot judge (the run's own checks name what is wrong with it)."""
    try:
        without, split = (device_plan(hf_config, dataclasses.replace(config, distributed_optimizer=on))["total"]
                          for on in (False, True))
    except ValueError:
        return True
    return without - split >= DISTRIBUTED_OPTIMIZER_MIN_SAVING


def _candidates(hf_config, config):
    """(flag, config) pairs: one change each, towards less memory per device."""
    c = config
    if not c.distributed_optimizer and max(data_parallel_sizes(c)) > 1:
        yield "--distributed-optimizer", dataclasses.replace(c, distributed_optimizer=True)
    for field, flag in (("tp", "--tp"), ("pp", "--pp"), ("ep", "--ep"), ("rollout_tp", "--rollout-tp")):
        if field != "ep" or "n_routed_experts" in hf_config:
            bigger = dataclasses.replace(c, **{field: getattr(c, field) * 2})
            if not layout_problems(hf_config, bigger) and bigger.tp <= max(c.tp, MAX_SUGGESTED_TP):
                yield f"{flag} {getattr(bigger, field)}", bigger
    for share in (0.25, 0.2, 0.15, 0.1):
        if share < c.gpu_memory_utilization:
            yield f"--gpu-memory-utilization {share}", dataclasses.replace(c, gpu_memory_utilization=share)
    tokens = c.micro_batch_tokens // 2
    while tokens >= 1024:
        yield f"--max-tokens-per-micro-batch {tokens}", dataclasses.replace(c, micro_batch_tokens=tokens)
        tokens //= 2


def what_to_change(hf_config, config, most=4):
    """(flags, plan): for a layout that does not fit, up to `most` changes taken greedily,
    each the one candidate (`_candidates`) that lowers the peak most, until it fits with
    every engine keeping some KV cache; the flags are [] and the plan None where none helps."""
    flags, current = [], config
    for _ in range(most):
        options = [(device_plan(hf_config, changed), flag, changed)
                   for flag, changed in _candidates(hf_config, current)]
        options = [option for option in options if all(kv > 0 for _, _, kv, _ in option[0]["engines"])]
        if not options:
            break
        plan, flag, current = min(options, key=lambda option: option[0]["total"])
        # A flag raised twice (--tp 2, then --tp 4) is said once, at its last value.
        flags = [given for given in flags if given.split()[0] != flag.split()[0]] + [flag]
        if plan["fits"]:
            return flags, plan
    return [], None


def format_plan(plan, hf_config=None):
    """The plan as printed by `train_grpo.py --plan`: one line per part, per device, the
    verdict and, where it does not fit and `hf_config` is given, what to change."""
    c = plan["config"]
    stage = f", pipeline stage {plan['stage']} of {c.pp} (the busiest)" if c.pp > 1 else ""
    rows = [(f"weights ({'bf16' if c.bf16 else 'fp32'})", plan["weights"]),
            ("gradients (fp32 main_grad buffers)", plan["gradients"]),
            ("main weights (fp32)" + (", 1/dp" if c.distributed_optimizer else ""), plan["main_weights"]),
            ("Adam m and v (fp32)" + (", 1/dp" if c.distributed_optimizer else ""), plan["optimizer_states"])]
    if plan["reference_weights"]:
        rows.append(("reference model (--kl-coef)", plan["reference_weights"]))
    rows.append((f"activations, {c.micro_batch_tokens} tokens/micro-batch", plan["activations"]))
    notes = {}
    for name, weights, kv, per_token in plan["engines"]:
        rows.append((f"vLLM {name} engine: weights", weights))
        if c.device_memory:
            rows.append((f"vLLM {name} engine: KV cache", kv))
            notes[len(rows) - 1] = f"  {kv // per_token} tokens of {per_token} bytes"
    rows += [("train phase (vLLM asleep)", plan["train_phase"]), ("rollout phase (vLLM awake)", plan["rollout_phase"]),
             ("peak", plan["total"])]
    count = plan["parameters"]
    parameters = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
    lines = [f"memory plan per device: {parameters} parameters; world {c.world_size} = tp {c.tp} x "
             f"cp {c.cp} x pp {c.pp} x dp {plan['dp'] // c.cp}; experts ep {c.ep} x expert-dp {plan['expert_dp']}"
             f"{stage}"]
    lines += [f"  {label:<44}{count / 1e9:9.2f} GB{notes.get(index, '')}" for index, (label, count) in enumerate(rows)]
    if c.device_memory is None:
        return "\n".join(lines + ["  (--device-memory gives the verdict and vLLM's KV cache)"])
    lines.append(f"{'fits' if plan['fits'] else 'does NOT fit'} in --device-memory {c.device_memory / 1e9:.0f} GB "
                 "(CUDA context, NCCL buffers and fragmentation not counted: keep a few GB spare)")
    if not plan["fits"] and hf_config is not None:
        flags, fitting = what_to_change(hf_config, c)
        lines.append(f"  to fit: {' and '.join(flags)} (peak {fitting['total'] / 1e9:.1f} GB)" if flags else
                     "  no change of up to four flags makes it fit: more devices per model replica")
    return "\n".join(lines)
