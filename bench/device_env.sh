# Sourced by the bench scripts that run on the device machine (bash bench/on_device.sh, own_data_*.sh): from
# the repository root there, the carried wheels installed once (.device-wheels: hydra, omegaconf, submitit;
# .whl where present: nvImageCodec's), the launcher installed in place, $OUT made and $commit named.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ ! -e /tmp/site/.carried ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/*.whl || exit 1
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    fi
    touch /tmp/site/.carried
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
