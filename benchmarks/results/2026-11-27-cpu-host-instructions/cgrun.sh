#!/bin/bash
# cgrun.sh TREE OUTDIR: instructions per call of each case of cgsteps.py, for the checkout TREE.
here=$(dirname "$(readlink -f "$0")")
tree=$1; out=$(readlink -f "$2"); mkdir -p "$out"; rm -f "$out"/cg.out*
cd "$tree"
CG_N=${CG_N:-40} CG_NAMES=$out/names PYTHONPATH=$tree valgrind --tool=callgrind --collect-atstart=no \
  --toggle-collect=functools_reduce --dump-after=functools_reduce --callgrind-out-file=$out/cg.out \
  "${PYTHON:-python3}" "$here"/cgsteps.py > $out/log 2>&1
i=0
for f in $(ls $out/cg.out.* | sort -t. -k3 -n); do
  i=$((i+1)); name=$(sed -n ${i}p $out/names)
  ir=$(grep -m1 "^summary:\|^totals:" $f | awk '{print $2}')
  printf "%-26s %10.0f instr/call\n" "$name" $(echo "$ir / ${CG_N:-40}" | bc -l)
done
