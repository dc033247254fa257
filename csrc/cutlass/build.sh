#!/usr/bin/env bash
# Build libtcfm_cutlass.so (the DiT body's CUTLASS GEMMs for sm_90a, C ABI in tcfm_cutlass.h) with nvcc.
# No GPU and no torch needed: the library links the CUDA runtime statically and loads with ctypes.
#
#   bash csrc/cutlass/build.sh [OUT_DIR]          # default OUT_DIR: <repo>/build_cutlass
#
# Environment:
#   NVCC              the compiler (default: $CUDA_HOME/bin/nvcc, then /usr/local/cuda/bin/nvcc); CUDA >= 12.4
#   CUTLASS_INCLUDE   a folder holding cutlass/ and cute/ (skips the wheel)
#   CUTLASS_WHEEL     the nvidia-cutlass 4.2.0.0 wheel to unpack (default: one in the cache folder, else
#                     `pip download --no-deps nvidia-cutlass==4.2.0.0` into it)
#   TCFM_CUTLASS_CACHE  the cache folder (default: ${XDG_CACHE_HOME:-~/.cache}/torch_cfm)
#   JOBS              parallel nvcc processes (default: nproc)
#
# Writes OUT_DIR/libtcfm_cutlass.so, OUT_DIR/obj/*.o and OUT_DIR/build.log (nvcc's -Xptxas -v
# register and spill report per kernel, and the wall time of each translation unit).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$(mkdir -p "${1:-$REPO/build_cutlass}" && cd "${1:-$REPO/build_cutlass}" && pwd)"
CUTLASS_VERSION=4.2.0.0

NVCC="${NVCC:-}"
if [[ -z "$NVCC" ]]; then
  for cand in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
    if [[ -n "$cand" && -x "$cand" ]]; then NVCC="$cand"; break; fi
  done
fi
[[ -x "$NVCC" ]] || { echo "build.sh: nvcc not found (set NVCC or CUDA_HOME)" >&2; exit 1; }

cutlass_include() {
  if [[ -n "${CUTLASS_INCLUDE:-}" ]]; then
    [[ -f "$CUTLASS_INCLUDE/cutlass/version.h" ]] || { echo "build.sh: no cutlass/version.h under CUTLASS_INCLUDE=$CUTLASS_INCLUDE" >&2; exit 1; }
    echo "$CUTLASS_INCLUDE"; return
  fi
  local cache="${TCFM_CUTLASS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_cfm}"
  local root="$cache/cutlass-$CUTLASS_VERSION"
  local inc="$root/cutlass_library/source/include"
  if [[ ! -f "$inc/cutlass/version.h" ]]; then
    mkdir -p "$cache"
    local wheel="${CUTLASS_WHEEL:-}"
    if [[ -z "$wheel" ]]; then
      wheel="$(ls "$cache"/nvidia_cutlass-"$CUTLASS_VERSION"-*.whl 2>/dev/null | head -n 1 || true)"
    fi
    if [[ -z "$wheel" ]]; then
      python3 -m pip download --no-deps "nvidia-cutlass==$CUTLASS_VERSION" -d "$cache" >&2
      wheel="$(ls "$cache"/nvidia_cutlass-"$CUTLASS_VERSION"-*.whl | head -n 1)"
    fi
    # unpack only the C++ headers, into a temporary folder renamed at the end (no half-written cache)
    python3 - "$wheel" "$root" >&2 <<'PY'
import os, shutil, sys, tempfile, zipfile
wheel, root = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(dir=os.path.dirname(root))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")):
            z.extract(name, tmp)
if os.path.isdir(root):
    shutil.rmtree(root)
os.rename(tmp, root)
PY
  fi
  echo "$inc"
}

INC="$(cutlass_include)"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT/obj"
FLAGS=(-std=c++17 -O3 -DNDEBUG -lineinfo -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC
       --expt-relaxed-constexpr -DCUTLASS_ENABLE_GDC_FOR_SM90 -I"$INC" -I"$HERE" -Xptxas -v)

echo "nvcc: $("$NVCC" --version | tail -n 1)" > "$OUT/build.log"
echo "CUTLASS headers: $INC" >> "$OUT/build.log"
start=$(date +%s)
export NVCC OUT HERE
printf '%s\n' "$HERE"/*.cu | xargs -P "$JOBS" -I{} bash -c '
  src="$1"; shift
  obj="$OUT/obj/$(basename "${src%.cu}").o"
  # up to date: newer than its source, the local headers and this script
  if [[ -f "$obj" && -z "$(find "$src" "$HERE"/*.h "$HERE"/*.cuh "$HERE/build.sh" -newer "$obj" 2>/dev/null)" ]]; then
    exit 0
  fi
  t0=$(date +%s)
  if ! "$NVCC" "$@" -c "$src" -o "$obj.tmp" > "$obj.log" 2>&1; then cat "$obj.log" >&2; exit 255; fi
  mv "$obj.tmp" "$obj"
  echo "$(basename "$src"): $(( $(date +%s) - t0 )) s" >> "$obj.log"
' _ {} "${FLAGS[@]}"
OBJS=()
for src in "$HERE"/*.cu; do
  OBJS+=("$OUT/obj/$(basename "${src%.cu}").o")
  cat "$OUT/obj/$(basename "${src%.cu}").o.log" >> "$OUT/build.log"
done

# Export the tcfm_cutlass_* functions only: the static CUDA runtime's own symbols stay local, so a
# libcudart already in the process (torch's) cannot interpose on them.
printf '{ global: tcfm_cutlass_*; local: *; };\n' > "$OUT/exports.map"
"$NVCC" -shared -cudart static -Xlinker --version-script="$OUT/exports.map" -o "$OUT/libtcfm_cutlass.so.tmp" "${OBJS[@]}"
mv "$OUT/libtcfm_cutlass.so.tmp" "$OUT/libtcfm_cutlass.so"
echo "total: $(( $(date +%s) - start )) s with $JOBS jobs" >> "$OUT/build.log"
grep -E "^[a-z_0-9]+\.cu: [0-9]+ s|^total" "$OUT/build.log"
echo "registers/spills per kernel (ptxas):"
grep -E "Used [0-9]+ registers|spill" "$OUT/build.log" | paste - - | sed -E 's/ +/ /g' | sort | uniq -c
echo "built $OUT/libtcfm_cutlass.so"
