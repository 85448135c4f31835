"""Generate text from a checkpoint: `python sample.py --checkpoint DIR --prompt "The "`.

DIR is any of: a run's checkpoint directory (`[checkpoint].dir`: its latest step is used), one step's
checkpoint (`.../step_00000300`), or a Hugging Face directory (config.json and safetensors).
Tokens are printed as they are chosen. The tokenizer is the one the run trained with (its
train_config.json), else the directory's tokenizer.json, else the byte tokenizer; --tokenizer overrides.
train.py draws its end-of-run sample with the same `generate_text`.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from checkpoint_files import is_native_checkpoint
from decoder import stream
from tokenizer import Tokenizer, TokenizerError, load_tokenizer


class SampleError(ValueError):
    """A checkpoint or tokenizer that cannot be sampled from; the message names it and says why."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(Path(args.checkpoint))
        tokenizer = sampling_tokenizer(checkpoint, args.tokenizer)
        start = time.perf_counter()
        model = load_model(checkpoint, args.device)
    except (SampleError, TokenizerError, ValueError, OSError) as error:
        raise SystemExit(f"error: {error}")
    print(f"loaded {checkpoint} ({model.num_params() / 1e6:.2f}M parameters) in {time.perf_counter() - start:.1f} s; "
          f"tokenizer of {tokenizer.vocab_size} tokens", file=sys.stderr, flush=True)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    for index in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {index + 1} of {args.num_samples} ---", flush=True)
        print(args.prompt, end="", flush=True)
        generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, generator,
                      on_text=lambda text: print(text, end="", flush=True))
        print(flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run's checkpoint dir (latest step), one step's checkpoint, or a Hugging Face dir")
    parser.add_argument("--prompt", default="The ", help="the text to continue")
    parser.add_argument("--num-samples", type=positive, default=1, help="independent continuations, one after another")
    parser.add_argument("--max-new-tokens", type=positive, default=200, help="tokens per sample (fewer at <|endoftext|>)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=positive, default=None, help="sample among the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples")
    parser.add_argument("--tokenizer", default="auto",
                        help="auto (the run's, else the directory's tokenizer.json, else byte) or a "
                             "data.tokenizer value: byte, a tokenizer.json directory, a .tiktoken file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is available; use --device cpu")
    return args


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ============================================================================= what to load

def is_hf_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or the latest complete step_* inside a run's checkpoint dir."""
    if is_native_checkpoint(path) or is_hf_checkpoint(path):
        return path
    if not path.is_dir():
        raise SampleError(f"--checkpoint {path}: no such directory")
    places = [path, *sorted(p for p in path.glob("run_*") if p.is_dir())]  # run directories, oldest first
    steps = [p for place in places for p in sorted(place.glob("step_*")) if p.suffix != ".tmp" and is_native_checkpoint(p)]
    if not steps:
        raise SampleError(f"--checkpoint {path}: not a checkpoint (no .metadata, no config.json with safetensors) "
                          f"and no complete step_* checkpoint inside")
    return steps[-1]


def load_model(checkpoint: Path, device: str = "cpu") -> torch.nn.Module:
    """FP32 weights on `device`, from a native or a Hugging Face checkpoint, in eval mode."""
    from convert import load_hf, load_native
    load = load_native if is_native_checkpoint(checkpoint) else load_hf
    return load(checkpoint, dtype=torch.float32, device=device).eval()


def sampling_tokenizer(checkpoint: Path, spec: str = "auto") -> Tokenizer:
    """The tokenizer named by `spec`; "auto": the run's (train_config.json next to the weights), else
    the checkpoint's tokenizer.json, else the byte tokenizer."""
    if spec != "auto":
        return load_tokenizer(spec)
    run_config = checkpoint / "train_config.json"
    if run_config.is_file():
        saved = json.loads(run_config.read_text())
        data, model = saved.get("data", {}), saved.get("model", {})
        return load_tokenizer(data.get("tokenizer", "byte"), data.get("eos_token", "<|endoftext|>"),
                              model.get("init_from", ""))
    if (checkpoint / "tokenizer.json").is_file():
        return load_tokenizer(str(checkpoint))
    return load_tokenizer("byte")


# ============================================================================= generating

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


def generate_text(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
                  temperature: float, top_k: int | None, generator: torch.Generator,
                  on_text: Callable[[str], None] | None = None) -> str:
    """Continue `prompt` -> the new text (without the prompt), ending early at the tokenizer's
    end-of-text. on_text receives each piece as soon as it decodes to whole characters."""
    device = next(model.parameters()).device
    ids = tokenizer.encoding.encode_ordinary(prompt) or [tokenizer.eos_id]
    allowed = decodable_ids(tokenizer, model.config.vocab_size).to(device)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    pieces = []
    for token in stream(model, torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, generator,
                        tokenizer.eos_id, allowed):
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
