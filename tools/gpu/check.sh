#!/usr/bin/env bash
# The GPU check in one command (issue 34). On a GPU machine, with tools/gpu/wheels/ carried there
# (tools/gpu/prepare.sh makes it here): installs the wheels into a private folder, runs the GPU-marked
# tests (tests/gpu/), then tools/gpu/bench_gpu.py, and writes report.md and report.json (plus the tests'
# log and JUnit XML) into --out. Sized for one H200 in at most 8 minutes: the tests get TEST_BUDGET_S,
# the benchmark what is left of TOTAL_BUDGET_S, and it skips (and lists) what would not fit.
#
#   tools/gpu/check.sh --out DIR            on the GPU machine
#   tools/gpu/check.sh --dry-run --out DIR  here, on the CPU: the same steps with tiny shapes (the GPU tests
#                                           run their code on the CPU; nothing is installed)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

DRY_RUN=0
OUT_DIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR="$2"; shift ;;
        --out=*) OUT_DIR="${1#--out=}" ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$OUT_DIR" ]; then
    echo "check.sh: --out DIR is required" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ "$DRY_RUN" = 1 ]; then
    PY=${PYTHON:-}
    [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
    TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-170}  # the dry run stays under 3 minutes
    TEST_BUDGET_S=${TEST_BUDGET_S:-80}
    BENCH_FLAGS=(--dry-run)
    export DIFFSERVE_GPU_TESTS_DEVICE=cpu
else
    PY=${PYTHON:-python3}
    TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-450}  # 8 minutes on the GPU machine, with margin
    TEST_BUDGET_S=${TEST_BUDGET_S:-150}
    BENCH_FLAGS=()
    SITE=/tmp/diffserve-gpu-site
    if ls tools/gpu/wheels/*.whl >/dev/null 2>&1; then
        echo "[check] installing $(ls tools/gpu/wheels/*.whl | wc -l) wheels into $SITE"
        rm -rf "$SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" tools/gpu/wheels/*.whl \
            || { echo "[check] wheel install failed" >&2; exit 3; }
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        # The wheel must hold the code the tests here were written against: compare its sources with src/.
        "$PY" - <<'PYEOF'
import glob, pathlib, zipfile
wheel = next(iter(glob.glob("tools/gpu/wheels/diffserve-*.whl")), None)
if wheel:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("diffserve/") and n.endswith(".py")]
    with zipfile.ZipFile(wheel) as z:
        stale = [n for n in names if not pathlib.Path("src", n).is_file() or pathlib.Path("src", n).read_bytes() != z.read(n)]
    missing = [str(p.relative_to("src")) for p in pathlib.Path("src/diffserve").rglob("*.py") if str(p.relative_to("src")) not in names]
    if stale or missing:
        print(f"[check] WARNING: the diffserve wheel differs from src/ ({len(stale)} changed, {len(missing)} new files, "
              f"e.g. {(stale + missing)[:3]}): re-run tools/gpu/prepare.sh before the call")
PYEOF
    else
        echo "[check] no tools/gpu/wheels/ here (run tools/gpu/prepare.sh and carry it): using src/ and the machine's packages"
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null | sed 's/^/[check] /'
fi
"$PY" -c "import diffserve, torch; print('[check] diffserve', diffserve.__version__, 'from', diffserve.__file__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"

# 1. The GPU-marked tests (their own time limit; a hang or a failure does not stop the benchmark).
echo "[check] GPU tests (tests/gpu, at most ${TEST_BUDGET_S} s)"
timeout -k 10 "$TEST_BUDGET_S" "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    --junitxml="$OUT_DIR/tests.xml" >"$OUT_DIR/tests.log" 2>&1
TESTS_RC=$?
tail -n 25 "$OUT_DIR/tests.log"
echo "[check] tests exit code $TESTS_RC"

# 2. The benchmark, in what is left of the budget (keeping 15 s for the report).
ELAPSED=$(( $(date +%s) - START ))
LEFT=$(( TOTAL_BUDGET_S - ELAPSED - 15 ))
if [ "$LEFT" -lt 30 ]; then LEFT=30; fi
echo "[check] benchmark (budget ${LEFT} s)"
"$PY" tools/gpu/bench_gpu.py "${BENCH_FLAGS[@]}" --out "$OUT_DIR" --budget-s "$LEFT" \
    --tests-junit "$OUT_DIR/tests.xml" --tests-log "$OUT_DIR/tests.log" 2>&1 | tee "$OUT_DIR/bench.log" | grep -v '^\[bench\] [a-z_]*: {'
BENCH_RC=${PIPESTATUS[0]}
echo "[check] benchmark exit code $BENCH_RC; $(( $(date +%s) - START )) s in all; report: $OUT_DIR/report.md"
[ -f "$OUT_DIR/report.md" ] && [ -f "$OUT_DIR/report.json" ] || exit 4
exit "$BENCH_RC"
