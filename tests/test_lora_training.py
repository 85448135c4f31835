"""train.py with a [lora] section: the adapters train on the frozen init_from base, step 1 scores
the base's loss, checkpoints hold the adapters, their optimizer states and the base's identity,
resume bit-exact and only on that base; convert.py exports the run merged or as a PEFT adapter
directory. Bad [lora] input stops the run before any work, in one line naming the key."""

import codecs
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import convert
import lora
import sample
import train
from checkpoint_files import CheckpointError, read_metadata, write_checksums
from config import ConfigError
from helpers import (
    DEFAULT_FAMILY,
    ROOT,
    assert_close_to_scale,
    debug_args,
    exported_tensors,
    only,
    run_debug,
    run_two_processes,
    tiny_preset,
    train_losses,
)
from tokenizer import hf_tokenizer_files, load_tokenizer

LORA = [
    "--model.preset=",
    '--lora.targets=["all"]',
    "--lora.rank=8",
    "--training.sample_tokens=0",
    "--optim.lr=1e-2",
    "--logging.every=1",
]


def lora_run(tmp_path: Path, base: Path, *overrides: str) -> dict:
    return run_debug(tmp_path, f"--model.init_from={base}", *LORA, *overrides)


def checkpoint_of(tmp_path: Path, step: int) -> Path:
    return tmp_path / "ckpt" / "run_0001" / f"step_{step:08d}"


@pytest.mark.slow
def test_the_adapters_train_on_the_frozen_base(tmp_path, trained_once, monkeypatch):
    """Step 1's loss is the base's (B = 0: a full fine-tune from the same base scores the same rows
    alike), the loss falls, the optimizer holds the adapters alone and every base weight ends bit
    for bit as loaded."""
    optimizers = []
    build_optimizer = train.build_optimizer
    monkeypatch.setattr(
        train,
        "build_optimizer",
        lambda *args: optimizers.append(build_optimizer(*args)) or optimizers[-1],
    )
    base_state = convert.load_native(trained_once, torch.float32).state_dict()
    # One batch of 4 rows of 64 tokens, the same every step: the loss falls only if the adapters
    # learn, not because a later batch happens to be easier.
    corpus = tmp_path / "one_batch.txt"
    corpus.write_text(("The adapters learn this one batch by heart. " * 6)[:255])
    one_batch = [f"--data.path={corpus}", "--data.val_fraction=0", "--data.epochs=8"]
    lora_run(tmp_path / "lora", trained_once, "--training.steps=8", *one_batch)
    losses = train_losses(tmp_path / "lora")
    assert losses[8] < losses[1] - 0.05, losses
    optimized = {id(p) for group in optimizers[0].param_groups for p in group["params"]}
    run_debug(
        tmp_path / "full",
        f"--model.init_from={trained_once}",
        "--model.preset=",
        "--training.steps=1",
        "--training.sample_tokens=0",
        *one_batch,
    )
    assert losses[1] == train_losses(tmp_path / "full")[1]
    checkpoint = checkpoint_of(tmp_path / "lora", 8)
    # the trained model: the base plus the adapters
    model = convert.load_native(trained_once, torch.float32)
    lora.apply_lora(model, lora.LoraConfig(rank=8, targets=["all"]))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable == set(lora.adapter_state(model.state_dict())) and len(optimized) == len(
        trainable
    )
    saved = {
        key.removeprefix("model.")
        for key in read_metadata(checkpoint).state_dict_metadata
        if key.startswith("model.")
    }
    assert saved == trainable  # the adapters only
    record = json.loads((checkpoint / lora.RUN_FILE).read_text())
    assert record["base"]["path"] == str(trained_once.resolve()) and record["lora"]["rank"] == 8
    assert set(base_state) == set(lora.without_adapters(model.state_dict()))


@pytest.mark.slow
def test_the_base_stays_bit_for_bit(tmp_path, monkeypatch):
    """The layout's own model after training: every frozen weight and buffer equal to the checkpoint
    it was loaded from, the routers' selection bias of a base balanced without a loss
    (aux-loss-free) included."""
    run_debug(
        tmp_path / "biased",
        "--training.steps=2",
        "--training.sample_tokens=0",
        "--model.router_bias_update_rate=0.01",
    )
    biased = checkpoint_of(tmp_path / "biased", 2)
    models = []
    parallelize = train.parallelize
    monkeypatch.setattr(
        train, "parallelize", lambda *args: models.append(parallelize(*args)) or models[-1]
    )
    lora_run(tmp_path / "lora", biased, "--training.steps=3")
    base = convert.load_native(biased, torch.float32).state_dict()
    assert any(
        key.endswith("selection_bias") and value.abs().max() > 0 for key, value in base.items()
    )
    trained = models[0].module.state_dict()
    for name, value in base.items():
        assert torch.equal(trained[name], value), name
    adapters = lora.adapter_state(trained)
    # they trained
    assert any(value.abs().max() > 0 for key, value in adapters.items() if key.endswith(".B"))


@pytest.mark.slow
def test_resume_is_bit_exact_and_only_on_the_same_base(tmp_path, trained_once):
    lora_run(tmp_path / "straight", trained_once, "--training.steps=4", "--checkpoint.every=2")
    middle = checkpoint_of(tmp_path / "straight", 2)
    lora_run(
        tmp_path / "resumed", trained_once, "--training.steps=4", f"--checkpoint.resume={middle}"
    )
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == straight[s] for s in (3, 4)), (
        straight,
        resumed,
    )

    other = tmp_path / "other_base"
    shutil.copytree(trained_once, other)
    elsewhere = (
        rf"command line --checkpoint.resume: checkpoint {middle} adapts the base "
        rf"{trained_once.resolve()}, not \[model\].init_from {other}"
    )
    with pytest.raises(CheckpointError, match=elsewhere):
        lora_run(tmp_path / "refused", other, "--training.steps=4", f"--checkpoint.resume={middle}")
    with pytest.raises(CheckpointError, match=rf"checkpoint {middle} holds LoRA adapters only"):
        run_debug(
            tmp_path / "full",
            f"--model.init_from={trained_once}",
            "--model.preset=",
            "--training.sample_tokens=0",
            f"--checkpoint.resume={middle}",
        )
    with pytest.raises(
        CheckpointError,
        match=r"holds adapters of \[lora\] rank 8.*this run asks "
        r"for rank 16",
    ):
        lora_run(
            tmp_path / "wider", trained_once, "--lora.rank=16", f"--checkpoint.resume={middle}"
        )
    with pytest.raises(CheckpointError, match=r"holds a whole model, not LoRA adapters"):
        lora_run(tmp_path / "whole", trained_once, f"--checkpoint.resume={trained_once}")


@pytest.mark.slow
def test_two_processes_train_as_one_and_their_checkpoint_resumes_in_one(tmp_path, trained_once):
    """train.py under EP 2 on gloo (FSDP over the 2 data-parallel ranks too): the base loaded into
    shards, the adapters initialised in theirs; its losses are one process's (2 micro-batches of the
    same 8 rows), and its sharded checkpoint resumes in one process as one's does."""
    common = [
        f"--model.init_from={trained_once}",
        *LORA,
        "--training.steps=3",
        "--checkpoint.every=2",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    run_debug(tmp_path / "one", *common, "--training.grad_accum=2")
    run_two_processes(
        debug_args(tmp_path / "two", *common, "--parallel.dp_shard=1", "--parallel.ep=2")
    )
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3] and all(
        two[s] == pytest.approx(one[s], rel=1e-5) for s in one
    ), (one, two)
    run_debug(
        tmp_path / "resumed",
        *common,
        "--training.grad_accum=2",
        f"--checkpoint.resume={checkpoint_of(tmp_path / 'two', 2)}",
    )
    assert train_losses(tmp_path / "resumed")[3] == pytest.approx(one[3], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("published_base", [False, True], ids=["native_base", "hugging_face_base"])
def test_export_merged_and_as_peft(tmp_path, trained_once, published_base):
    """convert.py to-hf on a LoRA checkpoint writes the merged model (its logits are the adapted
    model's) and to-peft the adapter directory (its tensors are convert.peft_state of the
    checkpoint's adapters); the run's own export_hf is the merged one. The base is read where the
    run read it: native, or Hugging Face (converted tensor by tensor, as train.py converted it)."""
    base = trained_once
    if published_base:
        base = tmp_path / "hf_base"
        convert.main(["to-hf", str(trained_once), str(base)])
    summary = lora_run(
        tmp_path,
        base,
        "--training.steps=3",
        f"--checkpoint.export_hf={tmp_path / 'run_export'}",
        "--training.sample_tokens=8",
    )
    assert "sample" in summary  # drawn from the checkpoint, merged in memory (sample.load_model)
    checkpoint = checkpoint_of(tmp_path, 3)
    convert.main(["to-hf", str(checkpoint), str(tmp_path / "merged")])
    base_hf = base if published_base else tmp_path / "base_hf"
    if not published_base:  # transformers cannot load a native base: to-peft names its to-hf export
        native = rf"^error: {re.escape(str(base.resolve()))}: the adapters' base is a native"
        with pytest.raises(SystemExit, match=rf"{native} checkpoint.* pass --base-hf BASE_HF$"):
            convert.main(["to-peft", str(checkpoint), str(tmp_path / "peft")])
        assert not (tmp_path / "peft").exists()
        convert.main(["to-hf", str(trained_once), str(base_hf)])
        with pytest.raises(SystemExit, match=r"^error: --base-hf .*/x: not a published checkpoint"):
            convert.main(
                [
                    "to-peft",
                    str(checkpoint),
                    str(tmp_path / "peft"),
                    "--base-hf",
                    str(tmp_path / "x"),
                ]
            )
    extra = [] if published_base else ["--base-hf", str(base_hf)]
    convert.main(["to-peft", str(checkpoint), str(tmp_path / "named"), "--base-hf", str(base_hf)])
    # the run's checkpoint directory: its newest step
    convert.main(["to-peft", str(tmp_path / "ckpt"), str(tmp_path / "peft"), *extra])
    model = convert.load_native(trained_once, torch.float32)
    lora.apply_lora(model, lora.LoraConfig(rank=8, targets=["all"]))
    adapters = convert.NativeDir(checkpoint).read(list(lora.adapter_state(model.state_dict())))
    model.load_state_dict(adapters, strict=False)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    merged = convert.load_hf(tmp_path / "merged", torch.float32)
    with torch.no_grad():
        assert_close_to_scale(merged(ids), model(ids), rtol=1e-5, what="merged logits")
        assert_close_to_scale(
            sample.load_model(checkpoint)(ids), model(ids), rtol=1e-5, what="sampled model's logits"
        )
        unadapted = convert.load_native(trained_once, torch.float32)
        # the adapters changed the model
        assert not torch.allclose(unadapted(ids), model(ids), atol=1e-4)
    written = exported_tensors(tmp_path / "peft")
    expected = convert.peft_state(adapters, convert.published_table(model.config))
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[key], value) for key, value in expected.items())
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft_config["r"] == 8
    assert peft_config["base_model_name_or_path"] == str(base_hf.resolve())
    written = {
        name: json.loads((tmp_path / "merged" / name).read_text(encoding="utf-8"))
        for name in ("tokenizer.json", "tokenizer_config.json")
    }  # the run's: byte
    assert written == hf_tokenizer_files(load_tokenizer("byte"))
    run_export = exported_tensors(tmp_path / "run_export")
    assert all(
        torch.equal(run_export[key], value)
        for key, value in exported_tensors(tmp_path / "merged").items()
    )


BAD_LORA = [
    (["--lora.rank=0"], r"command line --lora.rank: \[lora\] rank must be an integer > 0, got 0"),
    (
        ["--lora.alpha=nan"],
        r"command line --lora.alpha: \[lora\] alpha must be a finite number other than 0, got nan",
    ),
    (
        ["--lora.alpha=0"],
        r"command line --lora.alpha: \[lora\] alpha must be a finite number other than 0, got 0",
    ),
    (
        [f"--lora.rank={2**40}"],
        r"command line --lora.rank.*: \[lora\] rank must be at most \d+, the smaller side of the "
        rf"narrowest adapted map \(.*\), got {2**40}$",
    ),
    (
        ["--lora.dropout=-0.5"],
        r"command line --lora.dropout.*: \[lora\] dropout must be a number in \[0, 1\)",
    ),
    (
        ["--lora.targets=[]"],
        r"command line --lora.targets.*: \[lora\] targets must be a non-empty list",
    ),
    (
        ['--lora.targets=["qproj"]'],
        r"command line --lora.targets.*: \[lora\] targets: 'qproj' "
        r"matches no module",
    ),
    (
        ["--model.init_from=", f"--model.preset={tiny_preset(DEFAULT_FAMILY)}"],
        r"\[lora\] trains adapters on a frozen base: set \[model\].init_from",
    ),
    (
        ["--model.capacity_factor=1.25"],
        r"'all' matches layers\.\d+\.mlp\.experts: routed-expert "
        r"adapters need "
        r"experts_backend 'grouped' and no capacity_factor",
    ),
    (
        ["--parallel.fp8=rowwise"],
        r"command line --lora.targets.*command line --parallel.fp8: "
        r"\[lora\] with "
        r"\[parallel\] fp8 = 'rowwise' is not supported",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD_LORA)
def test_bad_lora_settings_stop_before_any_work(tmp_path, trained_once, overrides, message):
    args = debug_args(tmp_path, f"--model.init_from={trained_once}", *LORA, *overrides)
    with pytest.raises(ConfigError, match=message):
        train.main(args)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_lora_checkpoint_is_no_init_from(tmp_path, trained_once):
    lora_run(tmp_path / "lora", trained_once, "--training.steps=1")
    adapters_only = checkpoint_of(tmp_path / "lora", 1)
    with pytest.raises(
        ConfigError,
        match=rf"\[model\].init_from {adapters_only} is a LoRA run's "
        r"checkpoint",
    ):
        run_debug(tmp_path / "next", f"--model.init_from={adapters_only}", "--model.preset=")


@only("large4")
def test_the_large4_indexer_is_refused_as_a_target(tmp_path):
    from config import load_config
    from helpers import debug_configs

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(
        json.dumps(load_config(debug_configs()["large4"]).model_config.to_hf_config())
    )
    with pytest.raises(
        ConfigError,
        match=r"command line --lora.targets: \[lora\] targets: "
        r"'indexer' matches "
        r"layers.0.self_attn.indexer, which is frozen",
    ):
        load_config(
            debug_configs()["large4"],
            [f"--model.init_from={base}", "--model.preset=", '--lora.targets=["indexer"]'],
        )


# ========================================================== the base's identity, damaged lora.json


def model_only_copy(source: Path, out: Path, change: float = 1.0) -> Path:
    """A model-only native checkpoint of `source`'s weights, the embedding scaled by `change`: with
    1 and with 2, two models of the same shapes whose weight files have the same names and sizes."""
    model = convert.load_native(source)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(change)
    convert.save_native(model, model.config, out)
    return out


@pytest.mark.slow
def test_a_base_replaced_in_place_is_refused_everywhere(tmp_path, trained_once, capsys):
    """lora.json records the SHA-256 over the base's weight files' names, sizes and CRC-32s (read
    from its checksums.json); a base whose weights were replaced in place by another model of the
    same shapes is refused on resume, on to-hf and to-peft, and by sample.py, in one line naming the
    base and what changed. The same base, put back, is accepted (the refusal's boundary)."""
    base = model_only_copy(trained_once, tmp_path / "base").resolve()
    lora_run(tmp_path / "lora", base, "--training.steps=1")
    checkpoint = checkpoint_of(tmp_path / "lora", 1)
    listed = json.loads((base / "checksums.json").read_text())
    weights = sorted(name for name in listed if name == ".metadata" or name.endswith(".distcp"))
    sums = [[name, listed[name]["bytes"], listed[name]["crc32"]] for name in weights]
    recorded = json.loads((checkpoint / lora.RUN_FILE).read_text())["base"]["weights_sha256"]
    assert recorded == hashlib.sha256(json.dumps(sums).encode()).hexdigest()

    shutil.move(base, tmp_path / "kept")
    other = model_only_copy(trained_once, tmp_path / "other", change=2.0)
    assert sorted((f.name, f.stat().st_size) for f in other.glob("*.distcp")) == sorted(
        (f.name, f.stat().st_size) for f in (tmp_path / "kept").glob("*.distcp")
    )
    shutil.copytree(other, base)
    changed = (
        rf"weights \(SHA-256 {recorded[:12]} then, [0-9a-f]{{12}} now\) changed since the "
        rf"run started"
    )
    refusal = (
        rf"{re.escape(str(checkpoint / lora.RUN_FILE))}: the base {re.escape(str(base))} is "
        rf"not the one the adapters were trained on: its {changed}"
    )
    for command in ("to-hf", "to-peft"):
        with pytest.raises(SystemExit, match=rf"^error: {refusal}$"):
            convert.main([command, str(checkpoint), str(tmp_path / command)])
        assert not (tmp_path / command).exists()
    with pytest.raises(SystemExit, match=rf"^error: {refusal}$"):
        sample.main(["--checkpoint", str(checkpoint), "--device", "cpu", "--max-new-tokens", "2"])
    resume = ("--training.steps=2", f"--checkpoint.resume={checkpoint}")
    refused = (
        rf"checkpoint {re.escape(str(checkpoint))} adapts the base {re.escape(str(base))}, "
        rf"whose {changed}: resume"
    )
    with pytest.raises(CheckpointError, match=refused):
        lora_run(tmp_path / "resumed", base, *resume)

    shutil.rmtree(base)
    shutil.move(tmp_path / "kept", base)
    convert.main(["to-hf", str(checkpoint), str(tmp_path / "to-hf")])
    lora_run(tmp_path / "resumed", base, *resume)
    assert sorted(train_losses(tmp_path / "resumed")) == [2]


@pytest.mark.slow
def test_to_peft_refuses_a_base_with_the_selection_bias(tmp_path):
    """A base that chooses experts with the aux-loss-free selection bias routes differently in
    transformers' model: to-peft refuses it in one line, as to-hf does (the accepted boundary, a
    base without it: test_export_merged_and_as_peft)."""
    run_debug(
        tmp_path / "base",
        "--training.steps=1",
        "--training.sample_tokens=0",
        "--model.router_bias_update_rate=0.01",
    )
    base = tmp_path / "base" / "ckpt" / "run_0001" / "step_00000001"
    lora_run(tmp_path / "lora", base, "--training.steps=1")
    refusal = (
        r"per-expert selection bias \(router_bias_update_rate = 0.01\), which the "
        r"published format"
    )
    for command in ("to-peft", "to-hf"):
        with pytest.raises(SystemExit, match=rf"^error: .*{refusal}"):
            convert.main([command, str(tmp_path / "lora" / "ckpt"), str(tmp_path / command)])
        assert not (tmp_path / command).exists()


@pytest.mark.slow
def test_a_record_without_the_weights_checksum_warns_and_is_used(tmp_path, trained_once, capfd):
    """lora.json written before the base's weights were recorded: used (its base may well be
    intact), with one warning line saying the weights could not be checked."""
    lora_run(tmp_path / "lora", trained_once, "--training.steps=1")
    checkpoint = checkpoint_of(tmp_path / "lora", 1)
    record = json.loads((checkpoint / lora.RUN_FILE).read_text())
    del record["base"]["weights_sha256"]
    (checkpoint / lora.RUN_FILE).write_text(json.dumps(record))
    write_checksums(checkpoint)  # as such a checkpoint was saved
    capfd.readouterr()
    convert.main(["to-hf", str(checkpoint), str(tmp_path / "merged")])
    warning = (
        f"warning: {checkpoint / lora.RUN_FILE} records no checksum of its base's weights "
        f"(written before they were recorded): the base {trained_once.resolve()} is checked "
        f"by its config.json only"
    )
    assert capfd.readouterr().err.splitlines() == [warning]
    settings = lora.LoraConfig(rank=8, targets=["all"])
    assert lora.resume_refusal(checkpoint, settings, str(trained_once)) is None
    assert capfd.readouterr().err.splitlines() == [warning]


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, trained_once) -> Path:
    """One step of a LoRA run on trained_once, for the tests that copy it to damage it."""
    tmp_path = tmp_path_factory.mktemp("lora_once")
    lora_run(tmp_path, trained_once, "--training.steps=1")
    return checkpoint_of(tmp_path, 1)


def edited(change):
    def edit(record: dict) -> str:
        change(record)
        return json.dumps(record)

    return edit


DAMAGED_RECORDS = {
    "empty": (lambda record: "", r"cannot read JSON: Expecting value"),
    "invalid_json": (lambda record: "{", r"cannot read JSON"),
    "a_list": (lambda record: "[]", r"expected a JSON object, got a list"),
    "no_lora": (edited(lambda r: r.pop("lora")), r"lora is missing"),
    "no_rank": (edited(lambda r: r["lora"].pop("rank")), r"lora\.rank is missing"),
    "rank_a_string": (
        edited(lambda r: r["lora"].update(rank="8")),
        r"lora: rank must be an integer > 0, got '8'",
    ),
    "targets_a_string": (
        edited(lambda r: r["lora"].update(targets="all")),
        r"lora: targets must be a non-empty list of module names",
    ),
    "alpha_zero": (
        edited(lambda r: r["lora"].update(alpha=0)),
        r"lora: alpha must be a finite number other than 0",
    ),
    "base_a_list": (edited(lambda r: r.update(base=[1])), r"base must be a JSON object, got \[1\]"),
    "no_base_path": (edited(lambda r: r["base"].pop("path")), r"base\.path is missing"),
    "config_sha_null": (
        edited(lambda r: r["base"].update(config_sha256=None)),
        r"base\.config_sha256 must be a string, got None",
    ),
    "weights_sha_number": (
        edited(lambda r: r["base"].update(weights_sha256=7)),
        r"base\.weights_sha256 must be a string, got 7",
    ),
}


def damaged_copy(tmp_path: Path, lora_checkpoint: Path, damage) -> tuple[Path, str]:
    """A copy of the LoRA checkpoint, its lora.json damaged -> (the copy, the line refusing it)."""
    write, problem = damage
    checkpoint = tmp_path / "step_00000001"
    shutil.copytree(lora_checkpoint, checkpoint)
    record = json.loads((checkpoint / lora.RUN_FILE).read_text())
    (checkpoint / lora.RUN_FILE).write_text(write(record))
    write_checksums(checkpoint)  # written so at save time: the checksums do not catch it first
    line = (
        rf"{re.escape(str(checkpoint / lora.RUN_FILE))}: {problem}.*\(train.py writes this "
        rf"file with each checkpoint of a LoRA run; restore it from a copy\)$"
    )
    return checkpoint, line


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGED_RECORDS.values(), ids=DAMAGED_RECORDS.keys())
def test_a_damaged_lora_json_is_one_line_everywhere(tmp_path, lora_checkpoint, damage):
    """to-hf, to-peft and sample.py refuse a damaged lora.json in one line naming the file and the
    key (one changed after the save is caught by the checksums too)."""
    checkpoint, line = damaged_copy(tmp_path, lora_checkpoint, damage)
    for command in ("to-hf", "to-peft"):
        with pytest.raises(SystemExit, match=rf"^error: {line}"):
            convert.main([command, str(checkpoint), str(tmp_path / command)])
    with pytest.raises(SystemExit, match=rf"^error: {line}"):
        sample.main(["--checkpoint", str(checkpoint), "--device", "cpu", "--max-new-tokens", "2"])


@pytest.mark.parametrize("damage", ["empty", "no_rank", "weights_sha_number"])
def test_an_explicit_resume_refuses_a_damaged_lora_json(
    tmp_path, trained_once, lora_checkpoint, damage
):
    """A resume reads lora.json through the same check (read_run_record): a few of the damages above
    (each resume starts train.py)."""
    checkpoint, line = damaged_copy(tmp_path, lora_checkpoint, DAMAGED_RECORDS[damage])
    with pytest.raises(CheckpointError, match=rf"^{line}"):
        lora_run(tmp_path / "resumed", trained_once, f"--checkpoint.resume={checkpoint}")


# ================================================================== README, Fine-tuning, in order

REFERENCE_VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
REFERENCE_PYTHON = REFERENCE_VENV / "bin" / "python"  # tests/hf_venv.py's, with transformers
TINY = {
    "train.py": [
        "--training.steps=2",
        "--training.sample_tokens=0",
        "--training.eval_every=0",
        "--data.seq_len=64",
        "--training.batch_size=1",
        "--logging.peak_tflops=0.1",
    ],
    "sample.py": ["--max-new-tokens", "4", "--device", "cpu"],
    "convert.py": [],
}


def readme_commands(section: str) -> list[list[str]]:
    """The python3 commands of the first bash block of a README section, continuation lines joined
    and bash's $'...' quoting applied (shlex does not know it)."""
    text = (ROOT / "README.md").read_text().split(f"## {section}\n")[1]
    block = text.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")

    def ansi_c(match: re.Match) -> str:
        return shlex.quote(codecs.decode(match.group(1), "unicode_escape"))

    return [
        shlex.split(re.sub(r"\$'((?:[^'\\]|\\.)*)'", ansi_c, line))
        for line in block.splitlines()
        if line.startswith("python3 ")
    ]


@pytest.mark.slow
@pytest.mark.skipif("flint" != DEFAULT_FAMILY, reason="smoke.toml and sft-smoke.toml are Flint's")
def test_the_readmes_fine_tuning_commands_work_in_order(tmp_path, monkeypatch, capsys):
    """README, Fine-tuning, on a fresh clone (a directory holding only configs/ and data/), each
    command at 2 steps of 64 tokens: the exportable base, full SFT, LoRA SFT, a sample of the prompt
    with its newline, the merged export and the PEFT adapter directory, whose base transformers
    loads. With the reference venv, peft's AutoPeftModelForCausalLM loads the adapter directory from
    elsewhere and generates text."""
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    commands = readme_commands("Fine-tuning: SFT, LoRA, export")
    programs = [command[1] for command in commands]
    assert programs == ["train.py"] * 3 + ["sample.py", "convert.py", "convert.py"]
    modules = {"train.py": train, "sample.py": sample, "convert.py": convert}
    for command in commands:
        extra = [f"--data.cache_dir={tmp_path / 'cache'}"] if command[1] == "train.py" else []
        modules[command[1]].main(command[2:] + TINY[command[1]] + extra)
    # the prompt's newline reached sample.py as a newline, not a backslash and an n
    assert "User: What is a list?\nAssistant: " in capsys.readouterr().out
    adapter = tmp_path / "runs" / "sft-lora" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "runs" / "smoke" / "hf")
    if not REFERENCE_PYTHON.exists():
        pytest.skip(f"no reference venv {REFERENCE_PYTHON}: the adapter is not loaded by peft")
    script = (
        "import sys, torch; from transformers import AutoTokenizer\n"
        "from peft import AutoPeftModelForCausalLM\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])\n"
        "ids = tokenizer('User: What is a list?', return_tensors='pt')['input_ids']\n"
        "out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)\n"
        "print(type(model).__name__, out.shape[1] - ids.shape[1],"
        " repr(tokenizer.decode(out[0])))"
    )
    merged = adapter.parent / "merged"
    result = subprocess.run(
        [str(REFERENCE_PYTHON), "-c", script, str(adapter), str(merged)],
        cwd=ROOT.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    kind, new_tokens, text = result.stdout.strip().splitlines()[-1].split(" ", 2)
    assert kind.startswith("Peft") and 1 <= int(new_tokens) <= 6
    assert text.startswith("'User: What is a list?")
