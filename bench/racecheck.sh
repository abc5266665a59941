#!/usr/bin/env bash
# compute-sanitizer's racecheck over each variant of bench.racecheck_probe on an sm_90 GPU: one line per
# variant in SUMMARY (the hazards by severity from the sanitizer's summary, the kernels and code addresses of
# the hazards it displayed, the probe's own check, the exit status), each variant's whole log beside SUMMARY
# as <SUMMARY without extension>_<variant>.log.
#   bash bench/racecheck.sh SUMMARY [variant ...]    (default: handover descriptor attention)
# Hazards in `handover` alone come from gl.warp_specialize's hand-over of the partitions' arguments, not from
# the attention kernel (bench/racecheck_probe.py says how to read the rest). COMPUTE_SANITIZER names the
# sanitizer (default: compute-sanitizer on PATH); RACECHECK_ARGS adds options (e.g. "--print-limit 1000").
set -u
summary=${1:?usage: bash bench/racecheck.sh SUMMARY [variant ...]}
shift
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(handover descriptor attention)
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
if ! command -v "$sanitizer" >/dev/null 2>&1; then
    echo "bench/racecheck.sh: $sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
fi
mkdir -p "$(dirname "$summary")"
summary=$(cd "$(dirname "$summary")" && pwd)/$(basename "$summary")
stem=${summary%.*}
cd "$(dirname "$0")/.." || exit 2

tree=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
version=$("$sanitizer" --version 2>/dev/null | tail -n1)
stack=$(python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" 2>&1 | tail -n1)
echo "# racecheck (--racecheck-report hazard) on bench.racecheck_probe, tree $tree, ${gpu:-no GPU found}, $version, $stack" >"$summary"

failed=0
for variant in "${variants[@]}"; do
    log="${stem}_${variant}.log"
    # shellcheck disable=SC2086  # RACECHECK_ARGS: several options, split on purpose
    "$sanitizer" --tool racecheck --racecheck-report hazard ${RACECHECK_ARGS:-} \
        python3 -m bench.racecheck_probe --variant "$variant" >"$log" 2>&1
    rc=$?
    # "========= RACECHECK SUMMARY: 100 hazards displayed (107 errors, 0 warnings)"
    counts=$(grep -m1 "RACECHECK SUMMARY" "$log" | sed 's/^=* *RACECHECK SUMMARY: *//')
    errors=$(grep -m1 "RACECHECK SUMMARY" "$log" | grep -o "[0-9]* error" | grep -o "[0-9]*")
    warnings=$(grep -m1 "RACECHECK SUMMARY" "$log" | grep -o "[0-9]* warning" | grep -o "[0-9]*")
    # the displayed hazards' sides: "... Read access at _ws_fwd_kernel+0x110 in ..."; the offsets are SASS
    # addresses (bench.racecheck_probe --compile --sass DIR prints the probes' code)
    sites=$(grep -o "[A-Za-z]* access at [A-Za-z0-9_]*+0x[0-9a-f]*" "$log" | sed 's/ access at /@/' | sort | uniq -c |
        sort -rn | head -n 8 | awk '{printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1}')
    probe=$(grep -m1 -E "^(handover|descriptor|attention):" "$log")
    if [ -z "$counts" ]; then
        line="$variant: no racecheck summary (see $(basename "$log"))"
    else
        line="$variant: errors ${errors:-?}, warnings ${warnings:-?} ($counts)"
    fi
    echo "$line; sites: ${sites:-none}; probe: ${probe:-no output}; exit $rc" >>"$summary"
    [ "$rc" -eq 0 ] || failed=1
done
cat "$summary"
exit "$failed"
