"""mtp_patch on six megatron-core releases: the measurements behind the tests and docs/MTP_MATRIX.md's table.

    .venv/bin/python -m pytest test_all.py -k mtp_patch  # runs every release, writes .cache/mtp_matrix.md

Each release runs in its own Python process with the release's unzipped wheel first on
PYTHONPATH (0.17+ declare Python >= 3.12, but their pure-Python code runs on 3.11); the
wheels are fetched once per machine into .cache/ (gitignored). One process per release
builds the tiny models once and measures every behaviour unpatched and patched; the
tests assert on those values, and the run writes the table to
.cache/mtp_matrix.md. Tolerances: fp32 on CPU, 1e-5 relative where two computations
differ in order (recompute, a hand-written reference loss); identities are exact.

Each release's process imports this module (not the test suite) with the release first on
its path. Imports torch, the standard library and the project's own modules under test.
"""

import concurrent.futures
import dataclasses
import glob
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile

import torch
import torch.nn.functional as F

import mtp_patch

MTP_RELEASES = ("0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
MTP_BEHAVIOURS = {
    "decoupled": "1. MTP loss trains only the MTP layers (decouple=True)",
    "masked_shard": "2. per-token MTP loss; all-masked shard gives 0, finite grads",
    "labels_none": "3. labels=None forward skips MTP",
    "recompute": "4. full recompute through MTP layers",
    "unchanged": "5. decouple=False: logits, loss, grads as unpatched",
    "contract": "patch once, unpatch exactly, no signature probe per forward",
}
# What the unpatched release gets wrong; the tests check that the measurements catch it.
MTP_UPSTREAM_BROKEN = {
    "decoupled": set(MTP_RELEASES),
    "masked_shard": {"0.14.0", "0.15.3", "0.16.1"},
    "labels_none": set(MTP_RELEASES),
    "recompute": {"0.16.1", "0.17.1", "0.18.2"},
}
MTP_TRUNK_PARTS = ("output_layer", "embedding", "decoder")  # GPTModel submodules outside `mtp`
MTP_RELATIVE_TOLERANCE = 1e-5
MTP_LOSS_SCALING_FACTOR = 0.3  # explicit: 0.14/0.15 default to None; != 0.1 so the scale is seen
MTP_RELEASE_TIMEOUT_SECONDS = 600
REPO_DIR = os.path.dirname(os.path.abspath(__file__))
MEGATRON_CACHE_DIR = os.path.join(REPO_DIR, ".cache")
MTP_MATRIX_PATH = os.path.join(MEGATRON_CACHE_DIR, "mtp_matrix.md")


# ---------------------------------------------------------------------------------------
# Inside one release's process: tiny models, every behaviour unpatched and patched
# ---------------------------------------------------------------------------------------

def _gradients(model):
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def _max_abs(tensors):
    return max((float(t.abs().max()) for t in tensors), default=0.0)


def _norm(tensors):
    return float(torch.stack([t.norm() for t in tensors]).norm())


def _relative_difference(grads, reference):
    """max |grads - reference| / max |reference|; a gradient on one side only counts in full."""
    differences = [grads[name] - reference[name] for name in reference if name in grads]
    one_sided = [grads[name] for name in set(grads) - set(reference)]
    one_sided += [reference[name] for name in set(reference) - set(grads)]
    return _max_abs(differences + one_sided) / max(_max_abs(reference.values()), 1e-30)


def _attempt(measure, *args):
    """measure(*args), or {"error": "..."} when the release raises."""
    try:
        return measure(*args)
    except Exception as error:  # the release's own failure is a measurement here
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}


def _loss_and_gradients(model, batch, loss_mask):
    model.zero_grad()
    loss = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask,
                 **batch["extra"])
    loss.sum().backward()
    return loss.detach(), _gradients(model)


def _mtp_only_gradients(model, batch, loss_mask):
    """Gradients of the MTP loss alone: the main loss gets a zero gradient."""
    model.zero_grad()
    loss = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask)
    (loss * 0).sum().backward()
    return _gradients(model)


def _measure_decoupling(model, reference, batch):
    """Where the MTP loss alone sends gradient; the trunk's gradient against the trunk alone."""
    loss_mask = torch.ones_like(batch["labels"], dtype=torch.float32)
    grads = _mtp_only_gradients(model, batch, loss_mask)
    measured = {f"{part}_grad_max": _max_abs([g for name, g in grads.items() if name.startswith(part + ".")])
                for part in MTP_TRUNK_PARTS}
    measured["mtp_grad_norm"] = _norm([g for name, g in grads.items() if name.startswith("mtp.")])
    _, grads = _loss_and_gradients(model, batch, loss_mask)
    _, trunk_alone = _loss_and_gradients(reference, batch, loss_mask)
    measured["trunk_vs_trunk_alone"] = _relative_difference(
        {name: g for name, g in grads.items() if not name.startswith("mtp.")}, trunk_alone)
    return measured


def _roll(tensor):
    rolled = torch.roll(tensor, -1, -1)
    rolled[..., -1] = 0
    return rolled


def _mtp_gradient_against_hand_written_loss(model, batch, loss_mask):
    """Relative difference of the MTP layers' gradient from the MTP loss alone and from

        sum over depths k of  scale / layers * sum(mask_k * CE_k) / max(1, sum(mask_k))
                              (* sum(mask) with calculate_per_token_loss)

    where mask_k and the labels are rolled k times and CE_k uses depth k's hidden states.
    """
    config = model.config
    captured = []
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.append(output))
    model.zero_grad()
    try:
        loss = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask)
    finally:
        hook.remove()
    depth_outputs = torch.chunk(captured[-1], 1 + config.mtp_num_layers, dim=0)[1:]  # each [s, b, h]
    output_weight = model.output_layer.weight.detach()
    labels, mask, expected = batch["labels"], loss_mask, 0.0
    for hidden in depth_outputs:
        labels, mask = _roll(labels), _roll(mask)
        per_token = F.cross_entropy(F.linear(hidden, output_weight).permute(1, 2, 0), labels, reduction="none")
        depth_loss = config.mtp_loss_scaling_factor / config.mtp_num_layers * (mask * per_token).sum()
        depth_loss = depth_loss / mask.sum().clamp(min=1)
        if config.calculate_per_token_loss:
            depth_loss = depth_loss * loss_mask.sum()
        expected = expected + depth_loss
    names, params = zip(*[(name, p) for name, p in model.named_parameters() if name.startswith("mtp.")])
    expected_grads = torch.autograd.grad(expected, params, retain_graph=True, allow_unused=True)
    (loss * 0).sum().backward()
    grads = {name: g for name, g in _gradients(model).items() if name.startswith("mtp.")}
    return _relative_difference(grads, {name: g for name, g in zip(names, expected_grads) if g is not None})


def _measure_masked_shard(model, batch):
    """A partial loss mask against the hand-written loss (both loss modes); an all-zero mask."""
    loss_mask = torch.zeros_like(batch["labels"], dtype=torch.float32)
    loss_mask[0, 2:9] = 1
    loss_mask[1, :5] = 1  # position 0 rolls out: each depth counts fewer tokens than the mask
    loss_mask[1, 11:] = 1
    measured = {"normalisation_error": _mtp_gradient_against_hand_written_loss(model, batch, loss_mask)}
    # The test flips the mode on the built model: the config is read at every forward.
    model.config.calculate_per_token_loss = True
    try:
        measured["per_token_mode_error"] = _mtp_gradient_against_hand_written_loss(model, batch, loss_mask)
    finally:
        model.config.calculate_per_token_loss = False
    _, grads = _loss_and_gradients(model, batch, torch.zeros_like(loss_mask))
    measured["zero_mask_grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads.values())
    measured["zero_mask_mtp_grad_max"] = _max_abs([g for name, g in grads.items() if name.startswith("mtp.")])
    return measured


def _measure_labels_none(model, reference, batch):
    calls = []
    hook = model.mtp.register_forward_hook(lambda *args: calls.append(1))
    model.zero_grad()
    try:
        logits = model(batch["input_ids"], batch["position_ids"], None)
    finally:
        hook.remove()
    logits.sum().backward()
    with torch.no_grad():
        reference_logits = reference(batch["input_ids"], batch["position_ids"], None)
    return {
        "shape": list(logits.shape),
        "logits_difference": float((logits.detach() - reference_logits).abs().max()),
        "mtp_layer_calls": len(calls),
        "mtp_trained": _max_abs([g for name, g in _gradients(model).items() if name.startswith("mtp.")]) > 0,
    }


def _measure_recompute(plain, recompute, batch):
    loss_mask = torch.ones_like(batch["labels"], dtype=torch.float32)
    plain_loss, plain_grads = _loss_and_gradients(plain, batch, loss_mask)
    loss, grads = _loss_and_gradients(recompute, batch, loss_mask)
    return {
        "loss_difference": float((loss - plain_loss).abs().max()),
        "grad_difference": _relative_difference(grads, plain_grads),
        "mtp_grad_norm": _norm([g for name, g in grads.items() if name.startswith("mtp.")]),
    }


def _measure_outputs(model, batch):
    """Per-token loss and every gradient (labels, full mask); from 0.18 an output processor's result."""
    loss, grads = _loss_and_gradients(model, batch, torch.ones_like(batch["labels"], dtype=torch.float32))
    outputs = {"loss": loss, "grads": grads}
    if "output_processor" in inspect.signature(type(model).forward).parameters:
        def logits_processor(hidden_states, output_layer, output_weight, runtime_gather_output, **unused):
            return output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)[0]
        with torch.no_grad():
            outputs["processed"] = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
                                         output_processor=logits_processor)
    return outputs


def _compare_outputs(patched, unpatched):
    measured = {
        "loss_difference": float((patched["loss"] - unpatched["loss"]).abs().max()),
        "grad_difference": _relative_difference(patched["grads"], unpatched["grads"]),
    }
    if "processed" in unpatched:
        measured["output_processor_difference"] = float((patched["processed"] - unpatched["processed"]).abs().max())
    return measured


def _measure_contract(model, batch):
    """Counts and identities of patch/unpatch, and signature probes made per forward."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    def current():
        return (vars(GPTModel)["_postprocess"], vars(MultiTokenPredictionLayer)["_checkpointed_forward"],
                multi_token_prediction.roll_tensor)

    originals = current()
    # roll_tensor is replaced where it has a packed path (0.16+).
    measured = {"functions": 2 + ("packed_seq_params" in inspect.signature(originals[2]).parameters),
                "patch": mtp_patch.patch_megatron_mtp(), "patch_again": mtp_patch.patch_megatron_mtp()}
    try:
        mtp_patch.patch_megatron_mtp(decouple=False)
        measured["other_options_error"] = None
    except RuntimeError as error:
        measured["other_options_error"] = str(error)
    probes = []

    def counted_signature(*args, **kwargs):
        probes.append(args)
        return inspect.signature(*args, **kwargs)

    real_inspect = mtp_patch.inspect
    mtp_patch.inspect = types.SimpleNamespace(signature=counted_signature)
    try:
        mtp_patch.unpatch_megatron_mtp()
        measured["repatch"] = mtp_patch.patch_megatron_mtp()
        measured["probes_when_patching"] = len(probes)
        probes.clear()
        _loss_and_gradients(model, batch, torch.ones_like(batch["labels"], dtype=torch.float32))
        measured["probes_per_forward"] = len(probes)
    finally:
        mtp_patch.inspect = real_inspect
    measured["unpatch"] = mtp_patch.unpatch_megatron_mtp()
    measured["unpatch_again"] = mtp_patch.unpatch_megatron_mtp()
    measured["originals_restored"] = all(now is original for now, original in zip(current(), originals))
    # A release without a function the patches need: refused whole, nothing replaced.
    delattr(MultiTokenPredictionLayer, "_checkpointed_forward")
    try:
        mtp_patch.patch_megatron_mtp()
        measured["missing_piece_error"] = None
    except RuntimeError as error:
        measured["missing_piece_error"] = str(error)
    finally:
        MultiTokenPredictionLayer._checkpointed_forward = originals[1]
    measured["untouched_after_refusal"] = all(now is original for now, original in zip(current(), originals))
    return measured


def _packed_batch(vocab_size):
    """Two sequences (7 and 9 tokens) packed into one THD row."""
    from megatron.core.packed_seq_params import PackedSeqParams
    lengths = (7, 9)
    total = sum(lengths)
    input_ids = torch.randint(3, vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, lengths[0], total], dtype=torch.int32)
    fields = {field.name for field in dataclasses.fields(PackedSeqParams)}
    values = dict(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=cu_seqlens,
                  cu_seqlens_kv_padded=cu_seqlens, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return {
        "input_ids": input_ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "labels": torch.roll(input_ids, -1, dims=1),
        "extra": {"packed_seq_params": PackedSeqParams(**{k: v for k, v in values.items() if k in fields})},
    }


def _release_models():
    """(the model with 2 MTP layers, the trunk alone with the same weights, a padded batch,
    {case: (model, its full-recompute twin, batch)}) on this process's megatron-core."""
    import tiny_model
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    from megatron_model import build_gpt_model

    config = tiny_model.mimo_config(num_mtp_layers=2)
    # megatron's own attention for padded batches; packed (THD) batches need cp_attention's.
    options = {"mtp_loss_scaling_factor": MTP_LOSS_SCALING_FACTOR, "attention": "local"}
    model = build_gpt_model(config, **options)
    recompute_model = build_gpt_model(config, recompute=True, **options)
    reference = build_gpt_model(config, mtp=False, **options)  # the trunk alone, same weights
    recompute_model.load_state_dict(model.state_dict())
    assert not reference.load_state_dict(model.state_dict(), strict=False).missing_keys
    input_ids = torch.randint(3, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "position_ids": torch.arange(16).expand(2, 16),
             "labels": torch.roll(input_ids, -1, dims=1), "extra": {}}
    recompute_cases = {"padded": (model, recompute_model, batch)}
    # 0.14/0.15 MTP layers assert packed_seq_params is None: no packed sequences there.
    # Packed sequences make recompute carry a non-tensor (PackedSeqParams) through the MTP layer.
    if "packed_seq_params" in inspect.signature(MultiTokenPredictionLayer._get_embeddings).parameters:
        options["attention"] = "thd"
        packed_model = build_gpt_model(config, **options)
        packed_recompute = build_gpt_model(config, recompute=True, **options)
        packed_model.load_state_dict(model.state_dict())
        packed_recompute.load_state_dict(model.state_dict())
        recompute_cases["packed"] = (packed_model, packed_recompute, _packed_batch(config["vocab_size"]))
    return model, reference, batch, recompute_cases


def _mtp_release_measurements():
    """Every measurement on the megatron-core this process imports (run in a fresh process)."""
    import cpu_backend
    from megatron.core import package_info

    cpu_backend.init_distributed()
    cpu_backend.init_model_parallel(seed=1234)
    model, reference, batch, recompute_cases = _release_models()

    def measure_all():
        return {
            "decoupled": _attempt(_measure_decoupling, model, reference, batch),
            "masked_shard": _attempt(_measure_masked_shard, model, batch),
            "labels_none": _attempt(_measure_labels_none, model, reference, batch),
            "recompute": {case: _attempt(_measure_recompute, *models) for case, models in recompute_cases.items()},
        }

    unpatched = measure_all()
    unpatched_outputs = _measure_outputs(model, batch)
    contract = _measure_contract(model, batch)
    mtp_patch.patch_megatron_mtp(decouple=False)
    coupled = _attempt(_measure_decoupling, model, reference, batch)
    unchanged = _compare_outputs(_measure_outputs(model, batch), unpatched_outputs)
    # 0.14 - 0.16 give no logits with MTP layers unpatched; the trunk alone does, on every release.
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], None)
        unchanged["logits_vs_trunk_alone"] = float((logits - reference(batch["input_ids"], batch["position_ids"],
                                                                         None)).abs().max())
    mtp_patch.unpatch_megatron_mtp()
    mtp_patch.patch_megatron_mtp()
    patched = measure_all()
    mtp_patch.unpatch_megatron_mtp()
    return {
        "version": package_info.__version__,
        "megatron_path": os.path.dirname(package_info.__file__),
        "unpatched": unpatched,
        "patched": dict(patched, unchanged=unchanged, coupled=coupled, contract=contract),
    }


def release_child(out_path):
    """Entry point of one release's process: measurements as JSON to `out_path`."""
    torch.set_num_threads(1)
    try:
        import megatron.core  # noqa: F401 (does this release import here at all?)
    except Exception as error:
        result = {"unavailable": f"megatron-core does not import: {type(error).__name__}: {error}"}
    else:
        result = _mtp_release_measurements()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    # All is written: the interpreter's teardown of torch and megatron would add seconds per release.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------
# Verdicts: the same checks for the table and the tests
# ---------------------------------------------------------------------------------------

def behaviour_failures(behaviour, m):
    """What is wrong with `m`, one behaviour's measurements; [] when the behaviour holds."""
    if "error" in m:
        return [m["error"]]
    if behaviour == "recompute":  # one measurement per batch layout (padded, packed)
        return [f"{case}: {failure}" for case, measured in m.items()
                for failure in behaviour_failures("recompute_case", measured)]
    tolerance = MTP_RELATIVE_TOLERANCE
    failures = []

    def expect(holds, message):
        if not holds:
            failures.append(message)

    if behaviour in ("decoupled", "coupled"):
        reached = [part for part in MTP_TRUNK_PARTS if m[f"{part}_grad_max"] != 0.0]
        if behaviour == "coupled":  # decouple=False: the MTP loss trains everything, as upstream
            expect(reached == list(MTP_TRUNK_PARTS), f"MTP loss trains only {reached}")
        else:
            expect(not reached, f"MTP loss trains {', '.join(reached)}")
            expect(m["mtp_grad_norm"] > 0, "MTP layers get no gradient")
            expect(m["trunk_vs_trunk_alone"] <= tolerance,
                   f"trunk gradient differs from the trunk alone by {m['trunk_vs_trunk_alone']:.1e}")
    elif behaviour == "masked_shard":
        expect(m["normalisation_error"] <= tolerance,
               f"MTP gradient differs from per-token loss x scale/layers by {m['normalisation_error']:.1e}")
        expect(m["per_token_mode_error"] <= tolerance,
               f"calculate_per_token_loss: MTP gradient off by {m['per_token_mode_error']:.1e}")
        expect(m["zero_mask_grads_finite"], "non-finite gradients with an all-zero mask")
        expect(not m["zero_mask_grads_finite"] or m["zero_mask_mtp_grad_max"] == 0.0,
               f"MTP gradient {m['zero_mask_mtp_grad_max']:.1e} with an all-zero mask")
    elif behaviour == "labels_none":
        expect(m["logits_difference"] <= tolerance, f"logits differ from the trunk's by {m['logits_difference']:.1e}")
        expect(not m["mtp_layer_calls"], "runs the MTP layers")
        expect(not m["mtp_trained"], "trains the MTP layers (labels derived from input_ids)")
    elif behaviour == "recompute_case":
        expect(m["loss_difference"] <= tolerance, f"loss differs from no recompute by {m['loss_difference']:.1e}")
        expect(m["grad_difference"] <= tolerance, f"gradients differ from no recompute by {m['grad_difference']:.1e}")
        expect(m["mtp_grad_norm"] > 0, "MTP layers get no gradient")
    elif behaviour == "unchanged":  # exact: the same operations in the same order
        for name, value in m.items():
            expect(value == 0.0, f"{name} {value:.1e}")
    elif behaviour == "contract":
        counts = [m[key] for key in ("patch", "patch_again", "repatch", "unpatch", "unpatch_again")]
        functions = m["functions"]
        expect(counts == [functions, 0, functions, functions, 0],
               f"patch, again, unpatch+patch, unpatch, again returned {counts} ({functions} functions to replace)")
        expect(m["other_options_error"] is not None, "patching with other options while patched was accepted")
        expect(m["originals_restored"], "original functions not restored")
        expect(m["probes_per_forward"] == 0, f"{m['probes_per_forward']} signature probes per forward")
        expect(m["probes_when_patching"] > 0, "no probes counted when patching (counter broken)")
        expect(m["missing_piece_error"] is not None, "a missing function was not refused")
        expect(m["untouched_after_refusal"], "half-patched after a refusal")
    else:
        raise ValueError(f"unknown behaviour {behaviour!r}")
    return failures


def _cell(result, behaviour):
    if "unavailable" in result:
        return "cannot run: " + result["unavailable"].replace("|", "/")
    if "crashed" in result:
        return "FAIL: the release's process crashed (see the test log)"
    failures = behaviour_failures(behaviour, result["patched"][behaviour])
    if failures:
        return "FAIL: " + "; ".join(failures)
    cell = "pass"
    if behaviour == "recompute" and "packed" not in result["patched"]["recompute"]:
        cell += " (padded batches; this release's MTP refuses packed sequences)"
    if behaviour in result["unpatched"]:
        upstream = behaviour_failures(behaviour, result["unpatched"][behaviour])
        if upstream:
            cell += " (upstream: " + "; ".join(upstream) + ")"
    return cell.replace("|", "/")


def matrix_markdown(results):
    behaviours = list(MTP_BEHAVIOURS)
    lines = ["| megatron-core | " + " | ".join(MTP_BEHAVIOURS[b] for b in behaviours) + " |",
             "|---" * (1 + len(behaviours)) + "|"]
    for release in MTP_RELEASES:
        lines.append(f"| {release} | " + " | ".join(_cell(results[release], b) for b in behaviours) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Releases: fetched once per machine, one process each
# ---------------------------------------------------------------------------------------

def _megatron_release_dir(release):
    """(PYTHONPATH entry holding release's `megatron` package, None) or (None, why it cannot run)."""
    target = os.path.join(MEGATRON_CACHE_DIR, f"megatron-core-{release}")
    if os.path.exists(os.path.join(target, "megatron", "core", "__init__.py")):
        return target, None
    wheel_dir = os.path.join(MEGATRON_CACHE_DIR, "megatron-wheels")
    wheels = glob.glob(os.path.join(wheel_dir, f"megatron_core-{release}-*.whl"))
    if not wheels:
        # 0.17+ publish wheels for Python >= 3.12 only; ask for those for every release.
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", f"megatron-core=={release}", "-d", wheel_dir],
            capture_output=True, text=True, timeout=300)
        wheels = glob.glob(os.path.join(wheel_dir, f"megatron_core-{release}-*.whl"))
        if not wheels:
            return None, f"no wheel: pip download megatron-core=={release} failed: {download.stderr.strip()[-300:]}"
    unpacked = tempfile.mkdtemp(prefix=f"megatron-core-{release}-", dir=MEGATRON_CACHE_DIR)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(unpacked)
    try:
        os.rename(unpacked, target)
    except OSError:  # another session unpacked it first
        shutil.rmtree(unpacked)
    return target, None


def run_release(release):
    """One release's measurements from a fresh process; {"unavailable": why} or {"crashed": what} instead."""
    release_dir, why = _megatron_release_dir(release)
    if release_dir is None:
        return {"unavailable": why}
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "measurements.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([release_dir, REPO_DIR]))
        command = f"import {__name__} as tests; tests.release_child({out_path!r})"
        process = subprocess.run([sys.executable, "-c", command], cwd=REPO_DIR, env=env, capture_output=True,
                                 text=True, timeout=MTP_RELEASE_TIMEOUT_SECONDS)
        if process.returncode != 0 or not os.path.exists(out_path):
            return {"crashed": f"rc {process.returncode}: {process.stderr[-4000:]}"}
        with open(out_path) as f:
            result = json.load(f)
    if "version" in result and result["version"].split("+")[0] != release:
        return {"crashed": f"imported megatron-core {result['version']} from {result['megatron_path']}"}
    return result


def run_all_releases():
    """Measurements by release, all releases in parallel (one process per core); writes the table
    to MTP_MATRIX_PATH and returns {release: measurements}."""
    workers = max(1, min(len(MTP_RELEASES), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(MTP_RELEASES, pool.map(run_release, MTP_RELEASES)))
    os.makedirs(MEGATRON_CACHE_DIR, exist_ok=True)
    with open(MTP_MATRIX_PATH, "w") as f:
        f.write(matrix_markdown(results))
    return results
