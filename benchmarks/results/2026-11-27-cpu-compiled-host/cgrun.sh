#!/bin/bash
# cgrun.sh TREE OUTDIR: instructions per step of each case of cgsteps.py, for the checkout TREE.
# PYTHON: the interpreter itself (not a pyenv shim, which valgrind would follow instead).
here=$(dirname "$(readlink -f "$0")")
tree=$1; out=$(readlink -f "$2"); mkdir -p "$out"; rm -f "$out"/cg.out*
cd "$tree"
CG_N=${CG_N:-20} PYTHONPATH=$tree TORCHINDUCTOR_COMPILE_THREADS=1 valgrind --tool=callgrind \
  --instr-atstart=no --callgrind-out-file=$out/cg.out "${PYTHON:-python3}" "$here"/cgsteps.py \
  > $out/log 2>&1
for f in $(ls $out/cg.out.* | sort -t. -k3 -n); do
  name=$(grep -m1 "^desc: Trigger: Client Request: \|^desc: Trigger: " $f | sed 's/.*: //')
  ir=$(grep -m1 "^summary:\|^totals:" $f | awk '{print $2}')
  printf "%-22s %10.0f instr/step\n" "$name" $(echo "$ir / ${CG_N:-20}" | bc -l)
done
grep "graphs compiled" $out/log
