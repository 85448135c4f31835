#!/usr/bin/env bash
# One GPU, under 10 minutes: the checks of the CUDA-only code that the CPU suite cannot run.
#   bash scripts/gpu_check.sh            # run from the repository root; prints one verdict line per check
# 1. flex vs sdpa: tiny model, BF16 bulk and FP32, compiled blocks (fullgraph) with FlexAttention
#    against eager sdpa blocks on the same weights and a packed batch with padding: loss and grads.
# 2. a 30-step BF16 training run of flint-shallow through train.py (FSDP BF16 policy, compile on).
# 3. bench.py on the GPU shape (flint-shallow, batch 2 x 4096, BF16): eager and compiled rows, MFU.
# Outputs land in ${OUT:-runs/gpu_check}. A check that fails prints FAIL and its log's tail; the
# script goes on to the next and exits non-zero at the end.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
failed=0

verdict() {  # name, exit status, log
    if [ "$2" -eq 0 ]; then
        echo "PASS $1: $(tail -n 1 "$3")"
    else
        failed=1
        echo "FAIL $1 (exit $2), last lines of $3:"
        tail -n 15 "$3" | sed 's/^/    /'
    fi
}

timeout 180 python3 - > "$OUT/flex_vs_sdpa.log" 2>&1 <<'PY'
import dataclasses, torch
from model import FlintConfig, build_model
from parallel import apply_compile

assert torch.cuda.is_available(), "no GPU"
base = FlintConfig.from_name("tiny", num_hidden_layers=4, sliding_window=65)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, base.vocab_size, (2, 512), generator=g).cuda()
doc_ids = torch.tensor([0] * 200 + [1] * 280 + [-1] * 32).expand(2, 512).clone().cuda()
targets = ids.roll(-1, 1).masked_fill(doc_ids < 0, -100)
worst = []
for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
    results = {}
    for backend in ("sdpa", "flex"):
        model = build_model(dataclasses.replace(base, attention_backend=backend), "cuda", dtype, seed=0)
        if backend == "flex":
            apply_compile(model)  # fullgraph: a graph break fails the check
        loss = model(ids, targets, doc_ids=doc_ids)
        loss.backward()
        results[backend] = (loss.float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (loss_s, grads_s), (loss_f, grads_f) = results["sdpa"], results["flex"]
    loss_gap = (loss_f - loss_s).abs().item() / loss_s.abs().item()
    grad_gap = max(((grads_f[n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in grads_s.items())
    print(f"{dtype}: loss relative gap {loss_gap:.2e}, worst gradient relative gap {grad_gap:.2e} (limit {tolerance})")
    assert loss_gap < tolerance and grad_gap < tolerance, "flex and sdpa disagree"
    worst.append(f"{str(dtype)[6:]} loss {loss_gap:.1e} grad {grad_gap:.1e}")
print("compiled flex matches eager sdpa: " + "; ".join(worst))
PY
verdict "compiled flex vs sdpa (values, gradients)" $? "$OUT/flex_vs_sdpa.log"

cat > "$OUT/flint-shallow.toml" <<TOML
[model]
preset = "flint-shallow"
[data]
path = "data/python_reference.jsonl"
tokenizer = "byte"
seq_len = 4096
val_fraction = 0.05
epochs = 8
[training]
steps = 30
batch_size = 1
device = "cuda"
eval_every = 0
sample_tokens = 0
[optim]
lr = 3e-4
warmup_steps = 5
[checkpoint]
dir = "$OUT/ckpt"
every = 0
resume = "never"
[logging]
every = 5
jsonl = "$OUT/train.jsonl"
[parallel]
compile = true
param_dtype = "bfloat16"
TOML
timeout 300 python3 train.py --config "$OUT/flint-shallow.toml" > "$OUT/train.log" 2>&1
status=$?
if [ $status -eq 0 ]; then  # the loss must fall and stay finite
    python3 - "$OUT/train.jsonl" >> "$OUT/train.log" 2>&1 <<'PY' || status=1
import json, math, sys
losses = [r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
print(f"30 BF16 steps of flint-shallow: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
PY
fi
verdict "30-step BF16 flint-shallow run" $status "$OUT/train.log"

timeout 240 python3 bench.py --preset flint-shallow --device cuda --dtype bfloat16 --batch 2 --seq-len 4096 \
    --sections main,compiled --warmup 2 --reps 3 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
status=$?
if [ $status -eq 0 ]; then
    python3 - "$OUT/bench.json" >> "$OUT/bench.log" 2>&1 <<'PY' || status=1
import json, sys
rows = {r["name"]: r for r in json.load(open(sys.argv[1]))["rows"]}
eager, compiled = rows["flint (eager)"], rows["flint (compiled per block)"]
assert "error" not in compiled, compiled.get("error")
goal = "meets" if compiled["mfu"] >= 0.40 else "is below"
print(f"flint-shallow BF16: eager {eager.get('tokens_per_s', 0):.0f} tokens/s, compiled {compiled['tokens_per_s']:.0f} "
      f"tokens/s, {100 * compiled['mfu']:.1f} % MFU ({goal} the 40 % goal), {compiled['graph_breaks']} graph breaks")
PY
fi
verdict "bench.py flint-shallow on the GPU" $status "$OUT/bench.log"
exit $failed
