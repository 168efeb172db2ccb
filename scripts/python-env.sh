# Sourced by scripts/demo.sh and scripts/test.sh: sets PYTHON, the interpreter kvbridge is
# installed into and run with, without touching a system Python or your global packages:
#   - PYTHON=/path/to/python given: that one, as is;
#   - a virtual environment active (VIRTUAL_ENV): its python;
#   - otherwise .venv/ in the checkout, created on first use (git-ignored). Activate it later
#     with `. .venv/bin/activate` to have the `kvbridge` command on PATH.
if [[ -n "${PYTHON:-}" ]]; then
    :
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
else
    base="$(command -v python3 || command -v python || true)"
    [[ -n "$base" ]] || { echo "no python3 on PATH: install Python >= 3.11" >&2; exit 1; }
    if [[ ! -x .venv/bin/python ]]; then
        echo "== creating a virtual environment in .venv/ (packages go there, not into $base)"
        if ! "$base" -m venv .venv; then
            rm -rf .venv
            echo "cannot create .venv with '$base -m venv': install your system's venv" \
                "package (Debian/Ubuntu: python3-venv), or activate a virtual environment" \
                "first, or set PYTHON=/path/to/python" >&2
            exit 1
        fi
    fi
    PYTHON="$PWD/.venv/bin/python"
fi
export PYTHON
