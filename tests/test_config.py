"""config.py: TOML sections, dotted overrides, and errors that name the key and where it was set."""

import json
import os
import tomllib
from pathlib import Path

import pytest

from config import ConfigError, load_config
from helpers import DEFAULT_FAMILY, ROOT, debug_configs, only, registered, tiny_model_toml
from registry import family

CONFIGS = ROOT / "configs"
# configs/debug.toml (Flint); in a fork that keeps Large 4 its own
DEBUG = debug_configs()[DEFAULT_FAMILY]
TINY = tiny_model_toml()  # the [model] table of its smallest preset


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# The world size each config's comment runs it with (torchrun --nproc-per-node x --nnodes).
WORLD_SIZES = {
    "smoke": 1,
    "sft-smoke": 1,
    "debug": 1,
    "finetune": 8,
    "flint": 64,
    "flint-8gpu": 8,
    "flint-multinode": 32,
    "large4-smoke": 1,
    "large4-debug": 1,
    "large4": 256,
    "large4-256gpu": 256,
    "flint-lora": 2,
    "large4-lora": 48,
}
# The configs that continue a checkpoint: (its family, the config of the checkpoint they are tried
# on).
INIT_FROM = {
    "finetune": ("flint", lambda config: config.from_name("tiny", router_aux_loss_coef=0.0005)),
    "large4": ("large4", lambda config: config()),
    "flint-lora": ("flint", lambda config: config.from_name("tiny")),
    "large4-lora": ("large4", lambda config: config()),
}


def test_every_config_file_loads_and_its_layout_fits(tmp_path):
    """Every config file (a fork's own: those of the families it keeps) has its world size here."""
    checkpoints = {}
    for stem, (name, make) in INIT_FROM.items():
        if name in registered({name: None}):
            (tmp_path / stem).mkdir()
            (tmp_path / stem / "config.json").write_text(
                json.dumps(make(family(name).config).to_hf_config())
            )
            checkpoints[stem] = tmp_path / stem
    files = sorted(CONFIGS.glob("*.toml"))
    assert set(f.stem for f in files) <= set(WORLD_SIZES), sorted(f.stem for f in files)
    for file in files:
        checkpoint = checkpoints.get(file.stem)
        overrides = [f"--model.init_from={checkpoint}"] if checkpoint else []
        cfg = load_config(file, overrides)
        layout = cfg.parallel.resolve(WORLD_SIZES[file.stem], cfg.model_config.num_experts)
        assert layout.dp_shard >= 1, file


@only("flint")
def test_repository_configs_load():
    from flint_model import FlintConfig

    smoke = load_config(CONFIGS / "smoke.toml")
    assert smoke.model_config.vocab_size >= 257
    assert load_config(DEBUG).training.steps > 0
    flint = load_config(CONFIGS / "flint.toml")
    assert (
        flint.model_config.to_hf_config() == FlintConfig(output_router_logits=True).to_hf_config()
    )


@only("flint")
def test_finetune_config_takes_its_architecture_from_the_checkpoint(tmp_path):
    from flint_model import FlintConfig

    (tmp_path / "config.json").write_text(
        json.dumps(FlintConfig.from_name("tiny", router_aux_loss_coef=0.0005).to_hf_config())
    )
    cfg = load_config(CONFIGS / "finetune.toml", [f"--model.init_from={tmp_path}"])
    assert cfg.model_config.hidden_size == 64 and cfg.model_config.router_aux_loss_coef == 0.0005
    with pytest.raises(
        ConfigError,
        match=r"\[model\].hidden_size = 128 cannot be set with "
        r"init_from.*says 64",
    ):
        load_config(
            CONFIGS / "finetune.toml", [f"--model.init_from={tmp_path}", "--model.hidden_size=128"]
        )


def test_overrides_are_typed_toml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, TINY),
        [
            "--training.steps=7",
            "--optim.lr=1e-3",
            "--parallel.compile=true",
            "--data.path=notes/a b",
        ],
    )
    assert (cfg.training.steps, cfg.optim.lr, cfg.parallel.compile, cfg.data.path) == (
        7,
        1e-3,
        True,
        "notes/a b",
    )
    assert isinstance(load_config(write(tmp_path, TINY + "[optim]\nlr = 1\n")).optim.lr, float)


def test_a_text_key_takes_its_override_as_text(tmp_path):
    """--logging.profile_steps=5 names step 5 as the text "5" that the key holds (TOML would read an
    int), and a quoted value is still TOML."""
    cfg = load_config(
        write(tmp_path, TINY),
        ["--logging.profile_steps=5", "--checkpoint.resume='never'", "--training.steps=7"],
    )
    assert (cfg.logging.profile_steps, cfg.checkpoint.resume, cfg.training.steps) == (
        "5",
        "never",
        7,
    )


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("{tiny}[training]\nstepz = 3\n", [], r"run.toml: unknown key \[training\].stepz"),
        (
            '{tiny}[data]\noverlong = "cut"\n',
            [],
            r'run.toml: \[data\].overlong must be "truncate" or '
            r'"drop"',
        ),
        (
            '{tiny}[training]\nsteps = "3"\n',
            [],
            r"run.toml: \[training\].steps must be int, got str",
        ),
        ("{tiny}[parallel]\ncompile = 1\n", [], r"\[parallel\].compile must be bool, got int"),
        ("{tiny}[training]\ncompile = true\n", [], r"unknown key \[training\].compile"),
        pytest.param(
            '[model]\npreset = "tiny"\n[parallel]\nep = 3\n',
            [],
            r"run.toml: \[parallel\] ep "
            r"= 3 must divide .* = 8",
            marks=only("flint"),
        ),
        (
            "{tiny}",
            ["--parallel.pp_schedule=zigzag"],
            r"command line --parallel.pp_schedule: \[parallel\] pp_schedule must be one of",
        ),
        (
            "{tiny}",
            ["--parallel.accumulation=sync"],
            r"command line --parallel.accumulation: "
            r"\[parallel\] accumulation must be one of \['auto', 'sync_each', 'sync_last', "
            r"'gathered'\], "
            r"got 'sync'$",
        ),
        (
            '{tiny}[parallel]\nreshard_after_forward = "no"\n',
            [],
            r"\[parallel\].reshard_after_forward must be bool, got str",
        ),
        (
            "{tiny}[optim]\nlr = 0\n",
            [],
            r"run.toml: \[optim\].lr must be a finite number > 0, got 0.0",
        ),
        (
            "{tiny}",
            ["--training.steps=0"],
            r"command line --training.steps: \[training\].steps must be "
            r">= 1",
        ),
        (
            "{tiny}",
            ["--optim.lr=1e-5"],
            r"run.toml \(default\): \[optim\].min_lr must be in \[0, "
            r"optim.lr = 1e-05\]",
        ),
        ("{tiny}", ["--data.seq_len=5000"], r"max_position_embeddings = 4096"),
        (
            "{tiny}",
            ["--parallel.collective_timeout_minutes=0"],
            r"command line "
            r"--parallel.collective_timeout_minutes: \[parallel\] collective_timeout_minutes must "
            r"be a "
            r"number of minutes in \(0, ",
        ),
        (
            "{tiny}",
            ["--training.eval_every=5", "--data.val_fraction=0"],
            r"needs a validation split",
        ),
        ("{tiny}", ["--data.seq_len"], r"expected --section.key=value"),
        ("{tiny}[trainer]\nsteps = 1\n", [], r"unknown section \[trainer\]"),
        ("{tiny}hidden = 3\n", [], r"unknown key \[model\].hidden"),
        ('{tiny}hidden_size = "wide"\n', [], r"\[model\].hidden_size must be int"),
        pytest.param(
            '[model]\npreset = "huge"\n',
            [],
            r"run.toml: \[model\]: unknown model preset "
            r"'huge'",
            marks=only("flint"),
        ),
        pytest.param(
            '[model]\npreset = "tiny"\nnum_experts_per_tok = 99\n',
            [],
            r"num_experts_per_tok \(99\) must be <= num_experts",
            marks=only("flint"),
        ),
        ("[model]\n", [], r"\[model\] needs exactly one of preset, hf_config, init_from"),
        ('{tiny}hf_config = "x"\n', [], r"needs exactly one"),
        (
            '[model]\nhf_config = "missing/config.json"\n',
            [],
            r"\[model\].hf_config missing/config.json "
            r"does not exist",
        ),
        pytest.param(
            '[model]\npreset = "tiny"\nrouter_aux_loss_coef = -0.01\n',
            [],
            r"router_aux_loss_coef must be a finite number >= 0, got -0.01",
            marks=only("flint"),
        ),
        pytest.param(
            '[model]\npreset = "tiny"\nrouter_z_loss_coef = -0.001\n',
            [],
            r"router_z_loss_coef must be a finite number >= 0 \(0: off\), got -0.001",
            marks=only("flint"),
        ),
        ("[model\n", [], r"run.toml: not valid TOML"),
        (
            "{tiny}[data]\nseq_len = 100\n[parallel]\ncp = 4\n",
            [],
            r"run.toml: \[parallel\] cp = 4 .* data.seq_len = 100 must be divisible by 8",
        ),
        pytest.param(
            '[model]\npreset = "tiny"\nnum_hidden_layers = 3\n[parallel]\npp = 2\npp_schedule = '
            '"Interleaved1F1B"\n',
            [],
            r"run.toml: \[parallel\] pp = 2 with 2 stage\(s\) per rank makes 4 pipeline "
            r"stages, more than the "
            r"model's 3",
            marks=only("flint"),
        ),
        pytest.param(
            '[model]\npreset = "tiny"\nmoe_intermediate_size = 36\n',
            [],
            r"moe_intermediate_size must be a multiple of 8 .* got 36",
            marks=only("flint"),
        ),
        (
            "{tiny}[training]\nsample_temperature = inf\n",
            [],
            r"run.toml: \[training\].sample_temperature must be 0 \(greedy\) or a finite number >= "
            r"0.001, "
            r"got inf",
        ),
    ],
)
def test_config_errors_name_the_key_and_where(tmp_path, text, overrides, message):
    """{tiny}: the [model] table of the default family's smallest preset (Flint's "tiny"); the rows
    about Flint's own fields or numbers run when Flint is registered."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text.replace("{tiny}", TINY)), overrides)


@pytest.mark.parametrize("cp, seq_len, accepted", [(1, 63, True), (2, 63, False), (2, 64, True)])
def test_only_context_parallelism_needs_the_length_to_split_into_chunks(cp, seq_len, accepted):
    """An odd length is valid without context parallelism; with cp the error names parallel.cp."""
    overrides = [f"--data.seq_len={seq_len}", f"--parallel.cp={cp}", "--parallel.dp_shard=1"]
    if accepted:
        assert load_config(DEBUG, overrides).data.seq_len == seq_len
    else:
        with pytest.raises(
            ConfigError,
            match=r"command line --parallel.cp: \[parallel\] cp = 2 .* "
            r"by 4",
        ):
            load_config(DEBUG, overrides)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*nothere.toml"):
        load_config(tmp_path / "nothere.toml")


@only("flint")
@only("large4")
def test_model_family_comes_from_the_section_or_the_checkpoint(tmp_path):
    """Between two registered families: a config naming one refuses a checkpoint of the other."""
    Large4Config = family("large4").config
    large4 = load_config(CONFIGS / "large4-smoke.toml")
    assert (
        type(large4.model_config).__name__ == "Large4Config"
        and large4.model_config.hidden_size == 128
    )
    (tmp_path / "config.json").write_text(
        json.dumps(Large4Config.from_name("large4-tiny").to_hf_config())
    )
    run = write(tmp_path, f'[model]\nfamily = "flint"\ninit_from = "{tmp_path}"\n')
    with pytest.raises(
        ConfigError,
        match=r"\[model\].family = 'flint' but .* holds a 'large4' "
        r"model",
    ):
        load_config(run)
    with pytest.raises(ConfigError, match=r"\[model\].family must be one of flint, large4"):
        load_config(write(tmp_path, '[model]\nfamily = "llama"\npreset = "tiny"\n'))
    with pytest.raises(ConfigError, match="index_topk"):  # a random frozen indexer cannot select
        load_config(CONFIGS / "large4-smoke.toml", ["--data.seq_len=256"])
    run = load_config(CONFIGS / "large4-smoke.toml", ["--parallel.pp=2", "--parallel.cp=2"])
    assert (run.parallel.pp, run.parallel.cp) == (2, 2)


def test_paths_the_run_writes_are_checked_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    base = DEBUG
    cases = [
        (
            f"--checkpoint.dir={tmp_path / 'a_file'}",
            r"command line --checkpoint.dir: checkpoint.dir "
            r".*a_file is a file",
        ),
        (
            f"--data.cache_dir={tmp_path / 'a_file' / 'cache'}",
            r"data.cache_dir .* lies under "
            r".*a_file, which is a file",
        ),
        (
            f"--logging.jsonl={tmp_path / 'a_dir'}",
            r"logging.jsonl .*a_dir is a directory, expected "
            r"a file",
        ),
        (
            f"--checkpoint.export_hf={tmp_path / 'a_dir'}",
            r"export_hf .*a_dir already exists; the "
            r"export never overwrites",
        ),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(base, [override])


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories"
)
def test_a_read_only_checkpoint_dir_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=r"checkpoint.dir .*ro.* is not writable"):
        load_config(DEBUG, [f"--checkpoint.dir={tmp_path / 'ro' / 'ckpt'}"])


@only("flint")  # head_dim: Flint's field
def test_errors_of_command_line_overrides_name_the_command_line(tmp_path):
    from flint_model import FlintConfig

    debug = debug_configs()["flint"]
    with pytest.raises(
        ConfigError,
        match=r"^command line --model.head_dim: \[model\]: head_dim "
        r"must be even",
    ):
        load_config(debug, ["--model.head_dim=15"])
    config = tmp_path / "config.json"
    config.write_text(json.dumps(FlintConfig.from_name("tiny").to_hf_config()))
    with pytest.raises(
        ConfigError,
        match=r"debug.toml, command line --model.hf_config: \[model\] "
        r"needs exactly one",
    ):
        load_config(debug, [f"--model.hf_config={config}"])


def test_help_and_the_key_reference_list_every_key_with_its_default():
    import dataclasses

    from config import SECTIONS, help_text, toml_value

    text, readme = help_text(), (ROOT / "CONFIG.md").read_text()
    for name, cls in SECTIONS.items():
        assert f"[{name}]" in text and f"`[{name}]`" in readme
        for f in dataclasses.fields(cls):
            if f.name != "overrides":
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert (
                    f"{f.name} = {toml_value(default)}"
                    if default is not None
                    else f"{f.name} (unset)"
                ) in text
                assert f"| `{f.name}` |" in readme, f"CONFIG.md has no row for [{name}].{f.name}"


def test_print_config_loads_back_to_the_same_run_and_trains_nothing(tmp_path, capsys):
    import train

    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                "--config",
                str(DEBUG),
                "--print-config",
                "--training.steps=7",
                f"--checkpoint.dir={tmp_path / 'ckpt'}",
            ]
        )
    assert exit_info.value.code == 0 and not (tmp_path / "ckpt").exists()
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    again, original = (
        load_config(printed),
        load_config(DEBUG, ["--training.steps=7", f"--checkpoint.dir={tmp_path / 'ckpt'}"]),
    )
    assert again.model_config == original.model_config and again.training.steps == 7
    assert {k: v for k, v in again.to_dict().items() if k != "model"} == {
        k: v for k, v in original.to_dict().items() if k != "model"
    }


def test_init_from_a_runs_checkpoint_dir_takes_its_newest_intact_step(trained_once, tmp_path):
    """What a first run leaves in [checkpoint].dir can be named as it is, as sample.py's
    --checkpoint takes it."""
    runs = trained_once.parent.parent  # [checkpoint].dir, holding run_0001/step_00000001
    cfg = load_config(DEBUG, [f"--model.init_from={runs}", "--model.preset="])
    assert cfg.model.init_from == str(trained_once)
    # no checkpoint inside: none to take
    (tmp_path / "run_0001" / "step_00000002").mkdir(parents=True)
    with pytest.raises(
        ConfigError,
        match=r"command line --model.init_from: \[model\].init_from "
        r".*no complete step_",
    ):
        load_config(DEBUG, [f"--model.init_from={tmp_path}", "--model.preset="])


@pytest.mark.parametrize("value", ['"x"', '"6-5"', '"0"', '"3-21"', '"2-"', "21"])
def test_profile_steps_must_name_steps_of_the_run(value):
    """One line naming the key, what it takes and the run's last step (the debug configs train
    20)."""
    with pytest.raises(ConfigError) as error:
        load_config(DEBUG, [f"--logging.profile_steps={value}"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("command line --logging.profile_steps: ")
    assert "1 <= A <= B <= training.steps = 20" in message
    assert load_config(DEBUG, ["--logging.profile_steps=5-6"]).logging.profile_steps == "5-6"


# Issue 32's values that passed validation and failed deep inside (or trained on): one line each,
# naming the keys.
REFUSED = {
    "zbv with full checkpointing": (
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=ZBVZeroBubble",
            "--parallel.activation_checkpointing=full",
        ],
        r"command line --parallel.pp_schedule, command line "
        r"--parallel.activation_checkpointing: "
        r"\[parallel\] activation_checkpointing = 'full' cannot run "
        r"under pp_schedule "
        r"'ZBVZeroBubble'",
    ),
    "dualpipev with selective checkpointing": (
        [
            "--parallel.pp=2",
            "--parallel.pp_schedule=DualPipeV",
            "--parallel.activation_checkpointing=selective",
        ],
        r"activation_checkpointing = 'selective' cannot run "
        r"under pp_schedule "
        r"'DualPipeV'",
    ),
    "zbv with one micro-batch": (
        ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--parallel.pp_microbatches=1"],
        r"command line --parallel.pp_schedule, command line "
        r"--parallel.pp_microbatches: "
        r"\[parallel\] pp_microbatches = 1: pp_schedule 'ZBVZeroBubble' "
        r"needs at least 2",
    ),
    "dualpipev with fewer micro-batches than stages": (
        ["--parallel.pp=2", "--parallel.pp_schedule=DualPipeV", "--parallel.pp_microbatches=2"],
        r"\[parallel\] pp_microbatches = 2: "
        r"pp_schedule 'DualPipeV' needs at "
        r"least 4 \(one per pipeline stage: pp = 2 x "
        r"2 stages per rank\)",
    ),
    "capacity_factor nan": (
        ["--model.capacity_factor=nan"],
        r"command line "
        r"--model.capacity_factor: \[model\]: "
        r"capacity_factor must be a finite "
        r"number > 0 .* got nan",
    ),
    "capacity_factor inf": (
        ["--model.capacity_factor=inf"],
        r"capacity_factor must be a finite "
        r"number > 0 .* got inf",
    ),
    "muon_lr inf": (
        ["--optim.name=muon", "--optim.muon_lr=inf"],
        r"command line --optim.muon_lr: \[optim\].muon_lr must be a finite number > 0, "
        r"got inf",
    ),
    "lr inf": (
        ["--optim.lr=inf"],
        r"command line --optim.lr: \[optim\].lr must be a finite number "
        r"> 0, got inf",
    ),
    "weight_decay inf": (
        ["--optim.weight_decay=inf"],
        r"\[optim\].weight_decay must be a finite "
        r"number >= 0, got inf",
    ),
    "grad_clip inf": (
        ["--optim.grad_clip=inf"],
        r"\[optim\].grad_clip must be a finite number >= 0 "
        r"\(0: no clipping\)",
    ),
    "eps inf": (["--optim.eps=inf"], r"\[optim\].eps must be a finite number > 0, got inf"),
    "router z coefficient inf": (
        ["--model.router_z_loss_coef=inf"],
        r"command line --model.router_z_loss_coef: \[model\]: "
        r"router_z_loss_coef must be a "
        r"finite number >= 0 \(0: off\), got inf",
    ),
    "router sequence coefficient inf": (
        ["--model.router_sequence_loss_coef=inf"],
        r"router_sequence_loss_coef must be a finite number >= 0",
    ),
    "collective timeout 1e300": (
        ["--parallel.collective_timeout_minutes=1e300"],
        r"command line --parallel.collective_timeout_minutes: "
        r"\[parallel\] "
        r"collective_timeout_minutes must be a number of minutes in \(0, "
        r"525600\] \(a year\), "
        r"got 1e\+300",
    ),
}


# Of Flint's own fields.
FLINT_REFUSED = {
    "router aux coefficient inf": (
        ["--model.router_aux_loss_coef=inf"],
        r"router_aux_loss_coef must be a finite number >= 0, got inf",
    )
}


@pytest.mark.parametrize(
    "overrides, message",
    [pytest.param(*row, id=name) for name, row in REFUSED.items()]
    + [pytest.param(*row, id=name, marks=only("flint")) for name, row in FLINT_REFUSED.items()],
)
def test_impossible_and_non_finite_settings_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(write(tmp_path, TINY), overrides)
    assert "\n" not in str(refused.value)


# Each refusal's accepted boundary beside the nearest refused value, on the default family's tiny
# preset: (key, accepted value, refused value, other overrides both take). The refused value is one
# step (an integer, or a small number) past the boundary. The refusal names the key where it was
# set; the boundary loads, with the value set.
PIPELINE = ["--parallel.pp=2"]
ZBV = [*PIPELINE, "--parallel.pp_schedule=ZBVZeroBubble"]
DUALPIPE = [*PIPELINE, "--parallel.pp_schedule=DualPipeV"]
BOUNDARIES = [
    ("training.steps", "1", "0"),
    ("training.batch_size", "1", "0"),
    ("training.grad_accum", "1", "0"),
    ("training.seed", "0", "-1"),
    ("training.seed", str(2**64 - 1), str(2**64)),
    ("training.eval_every", "0", "-1"),
    ("training.eval_batches", "1", "0"),
    ("training.sample_tokens", "0", "-1"),
    ("training.sample_temperature", "0.001", "0.0009"),
    ("training.sample_temperature", "0.0", "-0.001"),
    ("data.seq_len", "1", "0"),
    ("data.seq_len", "4096", "4097"),
    ("data.val_fraction", "0.0", "-0.001"),
    ("data.val_fraction", "0.999", "1.0"),
    ("data.epochs", "1", "0"),
    ("optim.lr", "1e-300", "0.0", ["--optim.min_lr=0.0"]),
    ("optim.muon_lr", "1e-300", "0.0"),
    ("optim.muon_momentum", "0.0", "-0.001"),
    ("optim.muon_momentum", "0.999", "1.0"),
    ("optim.min_lr", "0.0", "-1e-9"),
    ("optim.min_lr", "1e-3", "0.0011", ["--optim.lr=1e-3"]),
    ("optim.warmup_steps", "0", "-1"),
    ("optim.decay_fraction", "1.0", "1.001"),
    ("optim.decay_fraction", "0.001", "0.0"),
    ("optim.weight_decay", "0.0", "-1e-9"),
    ("optim.beta1", "0.0", "-0.001"),
    ("optim.beta1", "0.999", "1.0"),
    ("optim.beta2", "0.0", "-0.001"),
    ("optim.beta2", "0.999", "1.0"),
    ("optim.eps", "1e-300", "0.0"),
    ("optim.grad_clip", "0.0", "-1e-9"),
    ("checkpoint.every", "0", "-1"),
    ("checkpoint.keep_last", "1", "0"),
    ("logging.every", "1", "0"),
    ("logging.peak_tflops", "0.0", "-0.001"),
    ("logging.idle_expert_steps", "0", "-1"),
    ("logging.profile_steps", '"1"', '"0"'),
    ("logging.profile_steps", '"1-100"', '"1-101"'),
    ("parallel.dp_replicate", "1", "0"),
    ("parallel.dp_shard", "1", "0"),
    ("parallel.ep", "1", "0"),
    ("parallel.pp", "1", "0"),
    ("parallel.cp", "1", "0"),
    ("parallel.ep_overlap", "1", "0"),
    ("parallel.collective_timeout_minutes", "525600", "525600.001"),
    ("parallel.pp_microbatches", "0", "-1"),
    ("parallel.pp_microbatches", "8", "3", PIPELINE),
    ("parallel.pp_microbatches", "2", "1", ZBV),
    ("parallel.pp_microbatches", "4", "2", DUALPIPE),
    ("parallel.activation_checkpointing", '"none"', '"selective"', ZBV),
    ("model.capacity_factor", "1e-9", "0.0"),
    ("model.router_z_loss_coef", "0.0", "-1e-9"),
    ("model.router_sequence_loss_coef", "0.0", "-1e-9"),
]
# Of Flint's tiny preset: 8 experts, 6 layers, widths in multiples of 8.
INTERLEAVED = ["--parallel.pp_schedule=Interleaved1F1B", "--parallel.pp_microbatches=2"]
FLINT_BOUNDARIES = [
    ("parallel.ep", "8", "3"),
    ("model.num_experts_per_tok", "8", "9"),
    ("model.moe_intermediate_size", "40", "36"),
    ("model.router_aux_loss_coef", "0.0", "-1e-9"),
    ("parallel.pp", "3", "4", INTERLEAVED),  # 2 stages per rank: 6 stages fit 6 layers, 8 do not
]


def loaded_value(cfg, key: str):
    """A dotted key's value as the run reads it ([model] keys from the model's config)."""
    section, name = key.split(".")
    return getattr(cfg.model_config if section == "model" else getattr(cfg, section), name)


def boundary_rows(rows: list[tuple], marks=()) -> list:
    return [
        pytest.param(key, accepted, refused, *others, id=f"{key}={accepted}", marks=marks)
        for key, accepted, refused, *others in rows
    ]


@pytest.mark.parametrize(
    "key, accepted, refused, others",
    boundary_rows([(*row, [])[:4] for row in BOUNDARIES])
    + boundary_rows([(*row, [])[:4] for row in FLINT_BOUNDARIES], only("flint")),
)
def test_each_refusal_accepts_its_boundary(tmp_path, key, accepted, refused, others):
    path = write(tmp_path, TINY)
    cfg = load_config(path, [*others, f"--{key}={accepted}"])
    assert loaded_value(cfg, key) == tomllib.loads(f"v = {accepted}")["v"]
    with pytest.raises(ConfigError) as refusal:
        load_config(path, [*others, f"--{key}={refused}"])
    message = str(refusal.value)
    assert "\n" not in message and f"command line --{key}" in message, message


# ----------------------------------------------------------------------------- [data].sources


def sources_toml(tmp_path: Path, entries: str, extra: str = "") -> Path:
    """A config whose [data] names `entries` as its sources; a/ and b/ exist under tmp_path."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir(exist_ok=True)
    return write(tmp_path, TINY + f"[data]\nsources = [{entries}]\n{extra}")


@pytest.mark.parametrize(
    "entries, extra, message",
    [
        (
            '{{path = "{t}/missing", weight = 1}}',
            "",
            r"sources\[0\]\.path .*missing does not exist",
        ),
        (
            '{{path = "{t}/a", weight = 0}}',
            "",
            r"sources\[0\]\.weight must be a finite number > 0, got 0",
        ),
        ('{{path = "{t}/a", weight = -0.5}}', "", r"sources\[0\]\.weight .*got -0\.5"),
        ('{{path = "{t}/a", weight = nan}}', "", r"sources\[0\]\.weight .*got nan"),
        ('{{path = "{t}/a", weight = inf}}', "", r"sources\[0\]\.weight .*got inf"),
        ('{{path = "{t}/a", weight = "1"}}', "", r"sources\[0\]\.weight .*got '1'"),
        ('{{path = "{t}/a"}}', "", r"sources\[0\]\.weight .*got None"),
        (
            '{{path = "{t}/a", weight = 1}}',
            'path = "{t}/b"\n',
            r"\[data\]\.sources and \[data\]\.path are both",
        ),
        ("", "", r"\[data\]\.sources is an empty list"),
        (
            '{{path = "{t}/a", weight = 1}}, {{path = "{t}/b/../a", weight = 2}}',
            "",
            r"sources\[1\] names .*again \(also sources\[0\]\)",
        ),
        (
            '{{path = "{t}/a", weight = 1, seq_len = 64}}',
            "",
            r"sources\[0\] has key 'seq_len'; .*shares",
        ),
        (
            '{{path = "{t}/a", weight = 1, tokenizer = "byte"}}',
            "",
            r"has key 'tokenizer'; .*shares",
        ),
        ('"{t}/a"', "", r"sources\[0\] must be a table"),
        ('{{path = "{t}/a", weight = 1}}', 'exhausted = "wrap"\n', r"\[data\]\.exhausted must be"),
    ],
)
def test_bad_sources_are_refused_in_one_line(tmp_path, entries, extra, message):
    file = sources_toml(tmp_path, entries.format(t=tmp_path), extra.format(t=tmp_path))
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(file)
    assert "\n" not in str(caught.value) and str(file) in str(caught.value)


def test_sources_accept_their_boundaries(tmp_path):
    """The smallest positive weight, two distinct paths, and each exhausted rule load as given."""
    entries = f'{{path = "{tmp_path}/a", weight = 5e-324}}, {{path = "{tmp_path}/b", weight = 3}}'
    file = sources_toml(tmp_path, entries, 'exhausted = "repeat"\n')
    cfg = load_config(file)
    assert [s["weight"] for s in cfg.data.sources] == [5e-324, 3]
    assert cfg.data.exhausted == "repeat"
    assert load_config(file, ['--data.exhausted="stop"']).data.exhausted == "stop"


def test_a_printed_mixture_loads_back_to_the_same_sources(tmp_path, capsys):
    """--print-config names the data once (sources, not also the default path), so it loads back."""
    import train

    file = sources_toml(tmp_path, f'{{path = "{tmp_path}/a", weight = 2}}')
    with pytest.raises(SystemExit):
        train.main(
            ["--config", str(file), "--print-config", f"--checkpoint.dir={tmp_path / 'ckpt'}"]
        )
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(printed).data.sources == [{"path": f"{tmp_path}/a", "weight": 2}]
