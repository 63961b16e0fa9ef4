# What the benchmark scripts share, process handling and the peers' venvs: `source
# "scripts/lib.sh"` from the repository root, after setting OUT (where the logs go). Every
# process a script starts goes into PIDS; stop_all ends them all, on exit too.

PIDS=()

# stop_all: end every process in PIDS and wait for each, so the next scenario's ports are free.
stop_all() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    PIDS=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# wait_ok URL: poll until URL answers 2xx, for at most 30 s.
wait_ok() {
    local url=$1 i
    for ((i = 0; i < 300; i++)); do
        curl -sf -o /dev/null --max-time 1 "$url" && return 0
        sleep 0.1
    done
    echo "$url did not become ready within 30 s (logs in $OUT/logs)" >&2
    return 1
}

# install_venv DIR PIN...: a venv at DIR holding exactly these pins (made again when they change).
install_venv() {
    local dir=$1
    shift
    if [[ ! -f $dir/.installed ]] || [[ $(cat "$dir/.installed") != "$*" ]]; then
        rm -rf "$dir"
        python3 -m venv "$dir"
        "$dir/bin/pip" install --quiet "$@"
        echo "$*" >"$dir/.installed"
    fi
}
