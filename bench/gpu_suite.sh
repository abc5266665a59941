#!/usr/bin/env bash
# The whole GPU test suite (pytest -m gpu) on one machine, in two parts run one after the other, with
# the ahead-of-time build installed first; the log names the tree, the GPUs and the host CPU.
#   bash bench/gpu_suite.sh TREE LOG [part]    part: a | b | all (default)
# RAGGED_SUITE_BUILT=1: ragged._C is already built and installed (two parts run at once on two
# GPUs, each with CUDA_VISIBLE_DEVICES set, must not build it at the same time).
# Part a: the kernel tests (attention, pack, pool, vocab, aot); part b: every other -m gpu test.
set -u
tree=${1:?tree}
log=${2:?log file}
part=${3:-all}
cd "$(dirname "$0")/.."
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))")
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
vers=$(python3 -c "import torch, triton, transformers, sentence_transformers as s; print(f'torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, sentence-transformers {s.__version__}')")
echo "# GPU tests at $tree on $gpus x $name, host CPU $cpu ($(nproc) cores), $vers" | tee -a "$log"
start=$(date +%s)
if [ -z "${RAGGED_SUITE_BUILT:-}" ]; then
    RAGGED_BUILD_CUDA=1 RAGGED_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . >>"$log" 2>&1
fi
python3 -c "import ragged._C as C; print('ragged._C built, sm', C.archs())" 2>&1 | tee -a "$log"
workers=$(( $(nproc) - 1 ))
(( workers > 15 )) && workers=15  # one H200 takes about 15 workers (more GPUs: the tests use the first)
# the test modules, wherever they sit under tests/ (folders mirror the package)
mapfile -t A < <(find tests \( -name "test_gpu_attention*.py" -o -name test_gpu_pack.py -o -name test_gpu_pool.py \
    -o -name test_gpu_vocab.py -o -name test_gpu_aot.py \) | sort)
mapfile -t ALL < <(grep -rl "mark.gpu" tests --include="test_*.py" | sort)
B=()
for f in "${ALL[@]}"; do
    case " ${A[*]} " in *" $f "*) ;; *) B+=("$f") ;; esac
done
run() {
    echo; echo "## part $1 ($(( $# - 1 )) files, -n $workers)"
    shift
    python3 -m pytest -m gpu -q -n "$workers" "$@" 2>&1 | tail -n 60
    echo "exit ${PIPESTATUS[0]}"
}
if [ "$part" = a ] || [ "$part" = all ]; then run A "${A[@]}" | tee -a "$log"; fi
if [ "$part" = b ] || [ "$part" = all ]; then run B "${B[@]}" | tee -a "$log"; fi
echo "wall $(( $(date +%s) - start )) s" | tee -a "$log"
