#!/usr/bin/env bash
# Install sfm and its extras into one Python environment: the HyperPod EKS image's (deploy/Dockerfile)
# or a virtual environment of its own (a HyperPod Slurm cluster's, e.g. on FSx). The installed-package
# test (tests/integration/test_installed_package.py) runs this same script, so the image's install steps
# are tested where no image is built.
#
#   deploy/install.sh [--python PY] [--venv DIR] [--torch SPEC] [--torch-index URL] [--extras a,b] SOURCE
#
#   SOURCE         a checkout of this repository (its wheel is built here with `pip wheel --no-deps`) or a
#                  built sfm wheel
#   --python PY    the interpreter to install into, or to create --venv from (default: python3)
#   --venv DIR     create DIR as a virtual environment (unless it exists) and install into it
#   --torch SPEC   torch to install when the environment has none (default: torch, which on Linux is
#                  PyPI's CUDA build); an environment's own torch is never replaced (the image's CUDA build)
#   --torch-index  an extra index for that torch, e.g. https://download.pytorch.org/whl/cu128
#   --extras a,b   sfm's extras to install too
#
# Anything else pip should know (an index, a cache, --no-compile) goes in its PIP_* environment variables.
set -euo pipefail

# The one place for extras whose build needs settings of their own: extra -> its build's environment
# variables (NAME=value) and pip options (--...). Each such extra is installed by a pip call of its own
# with them, after the package and the plain extras; e.g. [name]="SOME_BUILD_FLAG=0 --no-build-isolation".
declare -A EXTRA_BUILD=()

python=python3 venv="" torch_spec=torch torch_index="" extras="" source=""
while (($#)); do
    case "$1" in
        --python) python=$2; shift 2 ;;
        --venv) venv=$2; shift 2 ;;
        --torch) torch_spec=$2; shift 2 ;;
        --torch-index) torch_index=$2; shift 2 ;;
        --extras) extras=$2; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) source=$1; shift ;;
    esac
done
[[ -n $source ]] || { echo "install.sh: name the checkout or wheel to install (see --help)" >&2; exit 2; }

if [[ -n $venv ]]; then
    [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
    python=$venv/bin/python
fi
pip=("$python" -m pip)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -d $source ]]; then
    # build from a copy of what the wheel is made of, so a stale build/ or egg-info in the checkout
    # cannot leak into the wheel
    mkdir "$work/src"
    cp "$source/pyproject.toml" "$source/README.md" "$work/src/"
    cp -r "$source/sfm" "$work/src/sfm"
    find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
    "${pip[@]}" wheel --quiet --no-deps --wheel-dir "$work/dist" "$work/src"
    wheel=$(echo "$work"/dist/sfm-*.whl)
else
    wheel=$source
fi
[[ -f $wheel ]] || { echo "install.sh: no sfm wheel at $wheel" >&2; exit 2; }

# torch: the environment's own (the image's CUDA build), or SPEC where there is none; then pinned, with the
# packages built against it, so that no dependency's resolution replaces it
keep_torch() {
    "$python" - <<'EOF'
from importlib import metadata
for name in ("torch", "torchvision", "torchaudio", "triton"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
EOF
}
keep_torch > "$work/keep.txt"
if ! grep -q '^torch==' "$work/keep.txt"; then
    "${pip[@]}" install --quiet ${torch_index:+--extra-index-url "$torch_index"} "$torch_spec"
    keep_torch > "$work/keep.txt"
fi

plain=() built=()
IFS=, read -r -a wanted <<< "$extras"
for extra in "${wanted[@]}"; do
    [[ -z $extra ]] && continue
    if [[ -v EXTRA_BUILD[$extra] ]]; then built+=("$extra"); else plain+=("$extra"); fi
done
plain_list=$(IFS=,; echo "${plain[*]}")
"${pip[@]}" install --quiet --constraint "$work/keep.txt" "$wheel${plain_list:+[$plain_list]}"
for extra in "${built[@]}"; do
    envs=() options=()
    for word in ${EXTRA_BUILD[$extra]}; do
        if [[ $word == --* ]]; then options+=("$word"); else envs+=("$word"); fi
    done
    env "${envs[@]}" "${pip[@]}" install --quiet --constraint "$work/keep.txt" "${options[@]}" "$wheel[$extra]"
done

keep_torch > "$work/after.txt"
if ! cmp -s "$work/keep.txt" "$work/after.txt"; then
    echo "install.sh: the torch stack changed during the install:" >&2
    diff "$work/keep.txt" "$work/after.txt" >&2 || true
    exit 1
fi
# from / and isolated (-I), so the summary names what was installed, not a checkout on PYTHONPATH
(cd / && "$python" -I -c '
import sys, sfm, torch
print(f"install.sh: sfm {sfm.__version__} in {sys.prefix} (torch {torch.__version__}, CUDA {torch.version.cuda})")')
