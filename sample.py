"""Generate text from a checkpoint: `python sample.py --checkpoint DIR --prompt "The "`.

DIR is any of: a run's checkpoint directory (`[checkpoint].dir`: its newest intact step is used, a
damaged newer one skipped with a warning), one step's checkpoint (`.../step_00000300`), or a Hugging
Face directory (config.json and safetensors). A bad flag, checkpoint or tokenizer stops with one
line that names it. Tokens are printed as they are chosen. The tokenizer is the one the run trained
with (its train_config.json), else the directory's tokenizer.json, else the byte tokenizer;
--tokenizer overrides. train.py draws its end-of-run sample with the same `generate_text`."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from checkpoint_files import is_native_checkpoint, resolve_checkpoint
from flags import OneLineParser, positive
from generate import MIN_TEMPERATURE, stream, usable_temperature
from tokenizer import Tokenizer, TokenizerError, load_tokenizer


class SampleError(ValueError):
    """A checkpoint or tokenizer that cannot be sampled from; the message names it and says why."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(Path(args.checkpoint), "--checkpoint")
        tokenizer = sampling_tokenizer(checkpoint, args.tokenizer)
        start = time.perf_counter()
        model = load_model(checkpoint, args.device)
        check_request(model, tokenizer, args)
    except (SampleError, TokenizerError, ValueError, OSError) as error:
        raise SystemExit(f"error: {error}")
    print(
        f"loaded {checkpoint} ({model.num_params() / 1e6:.2f}M parameters) in "
        f"{time.perf_counter() - start:.1f} s; "
        f"tokenizer of {tokenizer.vocab_size} tokens",
        file=sys.stderr,
        flush=True,
    )
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    for index in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {index + 1} of {args.num_samples} ---", flush=True)
        print(args.prompt, end="", flush=True)
        generate_text(
            model,
            tokenizer,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            generator,
            on_text=lambda text: print(text, end="", flush=True),
        )
        print(flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a run's checkpoint dir (newest intact step), one step's checkpoint, "
        "or a Hugging Face dir",
    )
    parser.add_argument("--prompt", default="The ", help="the text to continue")
    parser.add_argument(
        "--num-samples",
        type=positive,
        default=1,
        help="independent continuations, one after another",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive,
        default=200,
        help="tokens per sample (fewer at <|endoftext|>)",
    )
    parser.add_argument("--temperature", type=temperature, default=0.8, help="0: greedy")
    parser.add_argument(
        "--top-k", type=positive, default=None, help="sample among the k likeliest tokens only"
    )
    parser.add_argument("--seed", type=seed, default=0, help="the same seed gives the same samples")
    parser.add_argument(
        "--tokenizer",
        default="auto",
        help="auto (the run's, else the directory's tokenizer.json, else byte) or a "
        "data.tokenizer value: byte, a tokenizer.json directory, a .tiktoken "
        "file",
    )
    parser.add_argument(
        "--device",
        type=device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda",
    )
    return parser.parse_args(argv)


def temperature(text: str) -> float:
    value = float(text)
    if not usable_temperature(value):
        raise argparse.ArgumentTypeError(
            f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {text}"
        )
    return value


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be 0 <= seed < 2**64, got {value}")
    return value


def device(text: str) -> str:
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda (cuda:N), got {text!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no GPU is available; use cpu")
    return text


# ============================================================================= what to load


def load_model(checkpoint: Path, device: str = "cpu") -> torch.nn.Module:
    """FP32 weights on `device`, from a native or a Hugging Face checkpoint (a LoRA run's: merged
    into its base), in eval mode."""
    from convert import load_hf, load_merged, load_native
    from lora import read_run_record

    load = load_native if is_native_checkpoint(checkpoint) else load_hf
    if read_run_record(checkpoint) is not None:
        load = load_merged
    model = load(checkpoint, dtype=torch.float32, device=device).eval()
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise SampleError(
                f"{checkpoint}: the checkpoint's weights are not finite ({name} holds "
                "NaN or inf); "
                f"it cannot be sampled from"
            )
    return model


def sampling_tokenizer(checkpoint: Path, spec: str = "auto") -> Tokenizer:
    """The tokenizer named by `spec`; "auto": the one the checkpoint was trained with
    (convert.run_tokenizer)."""
    from convert import run_tokenizer  # as the loaders above: convert.py loads torch.distributed

    return run_tokenizer(checkpoint) if spec == "auto" else load_tokenizer(spec)


def check_request(model: torch.nn.Module, tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    """What the model and tokenizer cannot serve, refused before any token is drawn, naming the
    flag."""
    vocab, context = model.config.vocab_size, model.config.max_position_embeddings
    if tokenizer.vocab_size > vocab:
        raise SampleError(
            f"--tokenizer {args.tokenizer}: {tokenizer.vocab_size} tokens, more than "
            "the model's "
            f"vocab_size = {vocab}; use the tokenizer the model was trained with"
        )
    prompt = len(prompt_ids(tokenizer, args.prompt))
    if prompt + args.max_new_tokens > context:
        raise SampleError(
            f"--max-new-tokens {args.max_new_tokens} and the prompt's {prompt} tokens "
            "exceed the "
            f"model's context of max_position_embeddings = {context} tokens; use at "
            "most "
            f"{max(context - prompt, 0)}"
        )


# ============================================================================= generating


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids (end-of-text alone for an empty prompt). tiktoken panics on a byte its
    ranks lack, so each byte is looked up first."""
    for char in dict.fromkeys(prompt):
        for byte in char.encode("utf-8"):
            try:
                tokenizer.encoding.encode_single_token(bytes([byte]))
            except KeyError:
                raise SampleError(
                    f"--prompt: character {char!r} (byte 0x{byte:02x}) has no token "
                    "in the "
                    f"tokenizer ({tokenizer.vocab_size} tokens)"
                ) from None
    return tokenizer.encoding.encode_ordinary(prompt) or [tokenizer.eos_id]


def decodable_ids(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: the ids the tokenizer can decode. A model's vocabulary is often padded
    (264 rows for the byte tokenizer's 257 tokens) and a tokenizer may have gaps: sampling one of
    the other ids would produce a token that has no text."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for token in range(min(vocab_size, tokenizer.vocab_size)):
        try:
            tokenizer.encoding.decode_single_token_bytes(token)
        except KeyError:
            continue
        allowed[token] = True
    return allowed


def generate_text(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Continue `prompt` -> the new text (without the prompt), ending early at the tokenizer's
    end-of-text. on_text receives each piece as soon as it decodes to whole characters."""
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt)
    allowed = decodable_ids(tokenizer, model.config.vocab_size).to(device)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    pieces = []
    for token in stream(
        model,
        torch.tensor([ids], device=device),
        max_new_tokens,
        temperature,
        top_k,
        generator,
        tokenizer.eos_id,
        allowed,
    ):
        token_id = int(token[0, 0])
        if token_id == tokenizer.eos_id:
            break
        piece = utf8.decode(tokenizer.encoding.decode_single_token_bytes(token_id))
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
    pieces.append(utf8.decode(b"", final=True))
    if on_text and pieces[-1]:
        on_text(pieces[-1])
    return "".join(pieces)


if __name__ == "__main__":
    main()
