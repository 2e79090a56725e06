#!/usr/bin/env bash
# What recording costs a real engine on the GPU machine (issue 33's measurements), in stages that fit the
# device tool's calls: each stage writes $OUT/<stage>.log; vLLM's stages need the pieces staged first
# (scripts/gpu/setup.sh). Every figure names the card it came from (nvidia-smi in env.log).
#
#   bash bench/gpu_overhead.sh ring                 # device ring and native drain tests (no vLLM needed)
#   bash bench/gpu_overhead.sh vllm ab              # real-vLLM cases; step-block A/B of the KV ring
#   CASES="v2-full-flash or cpu_offload" bash bench/gpu_overhead.sh vllm   # other cases (pytest -k)
#   AB_PAUSE=all VARIANTS=default REPS=90 bash bench/gpu_overhead.sh ab   # all of kvtrace on / off by blocks
#   AB_PAUSE=all VARIANTS=default,host-only REPS=100 bash bench/gpu_overhead.sh ab-gpus  # the same, a GPU each
#   VARIANTS=default,default,default,all-layers bash bench/gpu_overhead.sh ab-gpus  # four GPUs: a variant repeated
#   AB_CALLS=1 AB_PAUSE=all ... bash bench/gpu_overhead.sh ab   # also vLLM's methods timed by block (--ab-calls)
#   AB_CALLS=1 AB_PAUSE=all-threads VARIANTS=default,default REPS=90 bash bench/gpu_overhead.sh ab-gpus  # all of
#                                                   # kvtrace, its drain and writer threads' work in the on blocks
#                                                   # at its real rate (their clocks stop while held;
#                                                   # AB_PAUSE=all-threads-wall: wall clocks, the work that fell
#                                                   # due while held run in the on blocks)
#   AB_CALLS=1 VARIANTS=default,default AB_PAUSE=all-drain,all-writer REPS=90 bash bench/gpu_overhead.sh ab-gpus
#                                                   # only the one thread held (AB_PAUSE: one mode, or one a GPU)
#   AB_CALLS=1 AB_PAUSE=state VARIANTS=default,default REPS=90 bash bench/gpu_overhead.sh ab-gpus   # the ring's
#                                                   # state launch deferred / in begin_step, by blocks, both recording
#   AB_CALLS=1 AB_PAUSE=all-writer PIN=far VARIANTS=default REPS=45 bash bench/gpu_overhead.sh ab   # the engine
#                                                   # thread on one CPU, kvtrace's threads on other cores (PIN=near: on
#                                                   # its core's other hardware thread; engine: only the engine pinned)
#   AB_CALLS=1 AB_PAUSE=all-threads SKIP_KV_WRITES=all ... bash bench/gpu_overhead.sh ab   # the drains' KV record
#                                                   # frames built, not written (against the same without it;
#                                                   # SKIP_KV_WRITES=records: no block or timing record handed over)
#   AB_CALLS=1 AB_PAUSE=all-threads SKIP_KV_WRITES=records,none VARIANTS=default,default REPS=80 \
#       bash bench/gpu_overhead.sh ab-gpus          # the same two at once, a GPU each (none: everything written)
#                                                   # (a repetition takes 3.4-4.6 s with --ab-calls: REPS=110 fits
#                                                   # the stage's 570 s on a slow host; a process stopped by the
#                                                   # limit after its run still has its report, read from its result)
#   AB_CALLS=1 AB_PAUSE=load-process VARIANTS=default REPS=45 bash bench/gpu_overhead.sh ab   # a writer-like load
#                                                   # (copies and page-cache writes, LOAD_MB_S, default 33) in another
#                                                   # process by blocks, kvtrace recording in both (load-thread: on a
#                                                   # thread of the engine's process; LOAD_CHURN=1: each batch in memory of its own;
#                                                   # LOAD_HANDOVERS=N: N GIL hand-overs after each batch)
#   bash bench/gpu_overhead.sh gil                  # which thread holds the GIL, py-spy at 1 kHz
#   KVTRACE_PY_SPY_NATIVE=1 bash bench/gpu_overhead.sh gil   # with C frames (py-spy pauses the process)
#   bash bench/gpu_overhead.sh hooks                # kvtrace's per-step calls timed (--hook-times)
#   DRIVER_PROBE=1 VARIANTS=default bash bench/gpu_overhead.sh hooks   # and three more CUDA calls after begin_step
#   bash bench/gpu_overhead.sh throughput           # the throughput benchmark, engines side by side
#   bash bench/gpu_overhead.sh pairs                # two GPUs: each variant beside plain at the same time
#   bash bench/gpu_overhead.sh speed                # how steady the CPUs run identical work (no GPU use)
#   SHAPE=8b bash bench/gpu_overhead.sh rounds      # sequential processes, two rounds in turned order
#                                                   # (the 8B's engines do not fit the GPU together)
#
# SHAPE (default 1b) and REPS (default per stage) override the workload's size; VARIANTS the variants of
# the ab, gil, hooks, throughput, pairs and rounds stages (bench_gpu_throughput.py's names); CASES the vllm stage's cases
# (a pytest -k expression over tests/gpu/test_vllm_cuda.py; ~60 s a case, 9 fit the stage's 560 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvtrace-gpu}
export OUT
mkdir -p "$OUT"
. scripts/gpu/setup.sh
SHAPE=${SHAPE:-1b}
# the gil and hooks stages' workload: 256 prompts of 512 tokens, 256 out (decode-heavy) unless WORKLOAD says
# otherwise, e.g. WORKLOAD="--input-len 2048 --output-len 16" (prefill-heavy: most steps run attention eagerly)
WORKLOAD=${WORKLOAD:-}
{ nvidia-smi -L; lscpu; } >"$OUT/env.log" 2>&1  # the GPUs, and the CPUs' topology (cores, threads, caches)

run() {  # name timeout_s command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" | tee -a "$OUT/$name.log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log" | tail -n 40
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

for stage in "$@"; do
    case $stage in
    ring)
        run ring 300 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_device_ring.py \
            tests/unit/probes/test_kv_drain_native.py tests/unit/probes/test_kv_drain_loop.py tests/unit/probes/test_kv_ring.py ;;
    vllm)
        run vllm 560 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_vllm_cuda.py \
            -k "${CASES:-v2-default-flash or v1-default-flash or v2-eager-flash}" ;;
    ab)
        run ab 560 python3 bench/profile_engine_thread.py --shape "$SHAPE" --variants "${VARIANTS:-default,all-layers}" \
            --ab-blocks 16 --ab-pause "${AB_PAUSE:-records}" ${AB_CALLS:+--ab-calls} ${PIN:+--pin "$PIN"} \
            ${SKIP_KV_WRITES:+--skip-kv-writes "$SKIP_KV_WRITES"} ${LOAD_MB_S:+--load-mb-s "$LOAD_MB_S"} ${LOAD_CHURN:+--load-churn} ${LOAD_HANDOVERS:+--load-handovers "$LOAD_HANDOVERS"} --reps "${REPS:-10}" --out "$OUT/ab" ;;
    gil)
        run gil 540 env KVTRACE_GIL_RATE_HZ=1000 python3 bench/profile_engine_thread.py --shape "$SHAPE" \
            --variants "${VARIANTS:-default,host-only,all-layers}" --threads --reps "${REPS:-3}" --py-spy "${KVTRACE_PY_SPY:-}" \
            $WORKLOAD --out "$OUT/gil" ;;
    hooks)
        # apart from the gil stage: the timers' own frames would count in its GIL shares
        run hooks 420 python3 bench/profile_engine_thread.py --shape "$SHAPE" --variants "${VARIANTS:-default,host-only}" \
            --threads --hook-times ${DRIVER_PROBE:+--driver-probe} --reps "${REPS:-3}" $WORKLOAD --out "$OUT/hooks" ;;
    throughput)
        run throughput 560 python3 bench/bench_gpu_throughput.py --shapes "$SHAPE" --together \
            --variants "${VARIANTS:-plain,host-only,default,all-layers}" --rounds 1 --reps "${REPS:-10}" --out "$OUT/tp" ;;
    pairs)
        run pairs 580 python3 bench/bench_gpu_throughput.py --shapes "$SHAPE" --gpu-pairs \
            --variants "${VARIANTS:-plain,default,all-layers,plain-2}" --reps "${REPS:-10}" --out "$OUT/pairs" ;;
    ab-gpus)
        # the ab stage's variants at the same time, each on a GPU of its own and an equal share of the CPUs
        # (each A/B is paired inside its process: the other process is only more of the machine's noise)
        IFS=, read -ra vs <<<"${VARIANTS:-default,host-only}"
        IFS=, read -ra ps <<<"${AB_PAUSE:-all}"  # one mode for every GPU, or one a GPU
        IFS=, read -ra ks <<<"${SKIP_KV_WRITES:-none}"  # the same; none: everything written
        n=$(nproc) k=${#vs[@]} pids=()
        echo "=== ab-gpus: ${vs[*]} on $k GPUs, AB_PAUSE=${AB_PAUSE:-all} REPS=${REPS:-10}" | tee -a "$OUT/ab-gpus.log"
        # (a variant may be named more than once, e.g. default,default: the same A/B on two GPUs; each
        # process writes under its GPU's number)
        for i in "${!vs[@]}"; do
            CUDA_VISIBLE_DEVICES=$i timeout 570 taskset -c "$((i * n / k))-$(((i + 1) * n / k - 1))" \
                python3 bench/profile_engine_thread.py --shape "$SHAPE" --variants "${vs[$i]}" --ab-blocks 16 \
                --ab-pause "${ps[$i]:-${ps[0]}}" ${AB_CALLS:+--ab-calls} --reps "${REPS:-10}" --timeout 560 \
                $(skip=${ks[$i]:-${ks[0]}}; [ "$skip" = none ] || echo --skip-kv-writes "$skip") \
                --out "$OUT/ab-gpus/gpu$i" >"$OUT/ab-gpus-gpu$i-${vs[$i]}.log" 2>&1 &
            pids+=($!)
        done
        for i in "${!pids[@]}"; do
            wait "${pids[$i]}"
            rc=$? log="$OUT/ab-gpus-gpu$i-${vs[$i]}.log" result="$OUT/ab-gpus/gpu$i/$SHAPE-${vs[$i]}.txt"
            if [ "$rc" != 0 ] && [ -s "$result" ] && ! grep -q "paired over" "$log"; then
                # stopped by the time limit after its engine run wrote its result (the session's close,
                # the report): the report, read from the result
                python3 bench/profile_engine_thread.py --pool "$result" >>"$log" 2>&1
            fi
            echo "=== ab-gpus gpu$i ${vs[$i]}: exit $rc" >>"$log"
            tail -n 3 "$log" | tee -a "$OUT/ab-gpus.log"
        done
        [ "${#ps[@]}" -gt 1 ] || [ "${#ks[@]}" -gt 1 ] && vs=()  # different comparisons: nothing to pool
        for v in $(printf '%s\n' "${vs[@]}" | sort | uniq -d); do  # a variant on several GPUs: their pairs pooled
            python3 bench/profile_engine_thread.py --pool "$OUT"/ab-gpus/gpu*/"$SHAPE-$v.txt" 2>&1 \
                | sed "s/^/$v /" | tee -a "$OUT/ab-gpus.log"
        done ;;
    speed)
        n=$(nproc)
        run speed 60 python3 bench/cpu_speed_probe.py --cores "0,1,$((n / 2)),$((n - 1))" --seconds 20 ;;
    rounds)
        # 8B: 80-105 s a process once torch.compile's cache is warm (the first of a machine: ~160 s), so
        # two rounds of two variants fit one device call and two rounds of three do not
        run rounds 580 python3 bench/bench_gpu_throughput.py --shapes "$SHAPE" --rounds 2 --reps "${REPS:-3}" \
            --variants "${VARIANTS:-plain,default}" --out "$OUT/rounds" ;;
    *) echo "unknown stage $stage" ;;
    esac
done
