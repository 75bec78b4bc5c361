#!/usr/bin/env bash
# Why does an exception raised by pipecore._C crash the interpreter on some machines?
# Run from the repository root on the machine that crashes: `bash bench/extension_probe.sh OUTDIR`.
# It records the toolchain, builds the extension as setup.py does and in variants (each in its own copy
# of the tree, in parallel), runs the smallest raising call in each, and takes a native backtrace of the
# crash with a debugger when one is installed (gdb, or cuda-gdb, which also debugs host code).
set -u
out=${1:?usage: bash bench/extension_probe.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
jobs=${MAX_JOBS:-4}
repro='import faulthandler; faulthandler.enable()
import torch
from pipecore._C import Mailbox
m = Mailbox(); m.put(5, 1)
try:
    m.put(5, 2)
except KeyError as e:
    print("raised", type(e).__name__, e)
'
{
  echo "== toolchain"; uname -a; (c++ --version; ld --version) 2>&1 | head -3
  $py - <<'PY'
import sys, sysconfig, torch
print("python", sys.version, sysconfig.get_config_var("CC"))
print("torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("_PYBIND11_COMPILER_TYPE", "_PYBIND11_STDLIB", "_PYBIND11_BUILD_ABI"):
    print(name, getattr(torch._C, name, None))
print(torch.__config__.show())
try:
    import pybind11; print("pip pybind11", pybind11.__version__, pybind11.get_include())
except ImportError:
    print("no pip pybind11")
PY
  ls -d /usr/include/pybind11 /usr/local/include/pybind11 2>&1
  cxx=${CXX:-c++}; echo "CXX=${CXX:-(unset)}"
  for f in libstdc++.so libstdc++.so.6 libstdc++.a; do echo "$cxx -print-file-name=$f: $($cxx -print-file-name=$f)"; done
} > "$out/toolchain.txt" 2>&1

variant() {  # name, then sed expressions applied to setup.py in the copy
  local name=$1; shift
  local dir=/tmp/probe-$name
  rm -rf "$dir"; mkdir -p "$dir"
  cp -r setup.py pyproject.toml csrc kernels pipecore "$dir"/
  rm -f "$dir"/pipecore/_C*.so
  for expr in "$@"; do sed -i "$expr" "$dir/setup.py"; done
  (cd "$dir" && MAX_JOBS=$jobs $py setup.py build_ext --inplace > build.log 2>&1; echo "build rc=$?" >> build.log)
  cp "$dir/build.log" "$out/build-$name.log"
  cp "$dir"/build/temp*/build.ninja "$out/ninja-$name.txt" 2>/dev/null
  (cd "$dir" && timeout 60 $py -c "$repro" > "$out/run-$name.txt" 2>&1; echo "rc=$?" >> "$out/run-$name.txt")
  (cd "$dir" && ldd pipecore/_C*.so > "$out/ldd-$name.txt" 2>&1)
  # A copy of the C++ runtime inside the extension shows as defined std::locale symbols.
  echo "defined std::locale symbols: $(nm --defined-only "$dir"/pipecore/_C*.so 2>&1 | grep -c _ZNSt6locale)" >> "$out/run-$name.txt"
}

variant as_built &
variant without_shared_runtime 's/link_flags += _shared_cxx_runtime()/pass/' &
wait
for f in "$out"/run-*.txt; do echo "== $f"; cat "$f"; done

dbg=$(command -v gdb || command -v cuda-gdb || true)
if [ -n "$dbg" ] && [ "${PROBE_BACKTRACE:-1}" = 1 ]; then
  (cd /tmp/probe-without_shared_runtime && timeout 120 "$dbg" -batch -ex "set pagination off" -ex run -ex bt -ex "info sharedlibrary" \
     -ex "x/8i \$pc" --args $py -c "$repro" > "$out/backtrace.txt" 2>&1)
  (cd /tmp/probe-as_built && timeout 120 "$dbg" -batch -ex "set pagination off" -ex run -ex bt -ex "x/8i \$pc" \
     --args $py -c "$repro" > "$out/backtrace-as_built.txt" 2>&1)
fi
