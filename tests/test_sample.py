"""sample.py end to end: every kind of checkpoint directory, streaming, decodable ids only, and
train.py's end-of-run sample (after the export, never fatal)."""

import pytest
import torch

import convert
import sample
from helpers import DEFAULT_FAMILY, FAMILY_NAMES, build, run_debug, tiny_config, tiny_preset
from registry import family
from tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def sample_cli(capsys, *args: str) -> str:
    sample.main(list(args))
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_sample_from_a_run_a_step_and_an_export(tmp_path, capsys, name):
    summary = run_debug(
        tmp_path,
        "--training.steps=2",
        "--checkpoint.every=1",
        f"--checkpoint.export_hf={tmp_path / 'hf'}",
        family=name,
    )
    out = capsys.readouterr().out
    # the export comes first
    assert out.index("exported the model") < out.index("sample (16 tokens")
    # streamed as it was drawn
    assert summary["sample"].startswith("The ") and summary["sample"] in out
    ckpt = tmp_path / "ckpt"
    run_dir = ckpt / "run_0001"
    # a run's dir: its latest step
    assert sample.resolve_checkpoint(ckpt, "--checkpoint") == run_dir / "step_00000002"
    greedy = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    from_run = sample_cli(capsys, "--checkpoint", str(ckpt), *greedy)
    from_step = sample_cli(capsys, "--checkpoint", str(run_dir / "step_00000002"), *greedy)
    from_export = sample_cli(capsys, "--checkpoint", str(tmp_path / "hf"), *greedy)
    assert from_run.startswith("def ") and from_run == from_step == from_export
    several = sample_cli(
        capsys,
        "--checkpoint",
        str(ckpt),
        "--num-samples",
        "2",
        "--top-k",
        "5",
        "--seed",
        "3",
        "--max-new-tokens",
        "8",
    )
    assert several.count("--- sample ") == 2
    assert several == sample_cli(
        capsys,
        "--checkpoint",
        str(ckpt),
        "--num-samples",
        "2",
        "--top-k",
        "5",
        "--seed",
        "3",
        "--max-new-tokens",
        "8",
    )  # the seed decides


def test_bad_checkpoint_is_one_line(tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"^error: --checkpoint .*: not a checkpoint .*no complete "
        r"step_\*",
    ):
        sample.main(["--checkpoint", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^error: --checkpoint .*missing: no such directory"):
        sample.main(["--checkpoint", str(tmp_path / "missing")])


def forced_logits(model, sequence: list[int]) -> None:
    """Make decode_step favour, at step i, the id sequence[i] by far; ids 257.. (padding rows the
    byte tokenizer cannot decode) are favoured even more."""
    steps = iter(sequence)

    def decode_step(input_ids, caches, start):
        logits = torch.zeros(input_ids.shape[0], model.config.vocab_size)
        logits[:, next(steps)] = 50.0
        logits[:, 257:] = 100.0
        return logits

    model.decode_step = decode_step


def test_only_decodable_ids_and_whole_characters_stream():
    tokenizer = load_tokenizer("byte")
    # any model: its decode_step is forced
    model = build(tiny_config(DEFAULT_FAMILY, vocab_size=264), plain=True)
    assert sample.decodable_ids(tokenizer, 264).tolist() == [True] * 257 + [False] * 7
    # é: two bytes, two tokens
    forced_logits(model, [*"é".encode(), ord("!"), tokenizer.eos_id, ord("x")])
    pieces = []
    text = sample.generate_text(
        model, tokenizer, "A", 10, 0.0, None, torch.Generator(), on_text=pieces.append
    )
    assert text == "é!" and pieces == ["é", "!"]  # stops at end-of-text; never a half character
    forced_logits(model, [ord("a")] * 5)
    text = sample.generate_text(model, tokenizer, "A", 5, 1.0, 3, torch.Generator().manual_seed(0))
    assert text == "aaaaa"  # sampling too: the favoured padding ids are never drawn


@pytest.mark.slow
def test_a_failing_sample_keeps_the_checkpoint_and_export(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(sample, "generate_text", broken)
    summary = run_debug(tmp_path, "--training.steps=1", f"--checkpoint.export_hf={tmp_path / 'hf'}")
    assert "WARNING: the sample failed (RuntimeError: out of memory)" in capsys.readouterr().err
    assert "sample" not in summary
    assert (tmp_path / "hf" / "config.json").is_file() and (
        tmp_path / "ckpt" / "run_0001" / "step_00000001" / ".metadata"
    ).is_file()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_sample_from_a_native_checkpoint_is_the_models_greedy_text(tmp_path, capsys, name):
    """The same command and decoding loop for every model family: greedy text equals the model's own
    generate, from a native checkpoint (the byte tokenizer's 257 ids fit its 264)."""
    config = family(name).config.from_name(tiny_preset(name), vocab_size=264)
    model = build(config, plain=True)
    convert.save_native(model, config, tmp_path / name)
    out = sample_cli(
        capsys,
        "--checkpoint",
        str(tmp_path / name),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
    )
    tokenizer = load_tokenizer("byte")
    greedy = model.generate(torch.tensor([tokenizer.encoding.encode_ordinary("ab")]), 6)[
        0, 2:
    ].tolist()
    assert max(greedy) < 257  # with seed 0 no padding id wins, so the mask changes nothing here
    assert out == "ab" + tokenizer.decode(greedy) + "\n"
