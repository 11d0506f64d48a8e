#!/bin/sh
# A/B of the quantized matmul kernel: OLD (a git revision's quant_gemm.c, default main) against
# the working tree's, one thread, CPU-time minima, SmolLM2-135M shapes (960x576, 576x576,
# 3072x576, 576x1536). Run from the repo root:
#   sh bench/probes/quant_gemm_ab.sh [OLD_REV] [FLAGS] [TYPES] [MS] [PASSES]
# FLAGS: the level's compiler flags (default avx512: -march=x86-64-v4; avx512 + VNNI:
# "-march=x86-64-v4 -mavx512vnni"). TYPES: GGML ids (2 Q4_0, 3 Q4_1, 8 Q8_0). Prints per type,
# M and shape the old and new us per call, old/new, the max difference relative to max |y|, and
# per M the sum over the 4 shapes.
set -e
OLD=${1:-main}
FLAGS=${2:--march=x86-64-v4}
D=$(mktemp -d)
mkdir "$D/old"
git show "$OLD:replica/layers/csrc/quant_gemm.c" > "$D/old/quant_gemm.c"
CC="gcc -O3 -std=c11 $FLAGS -mtune=native -fopenmp -fno-fast-math -ffp-contract=off -fPIC"
# the old build's symbols renamed; its int8 units (quant_gemm_int8_*.c) where the revision has them
RENAME="-Dstepserve_quant_matmul=old_quant_matmul -Dstepserve_quant_isa=old_quant_isa
    -Dstepserve_quant_dequantize=old_quant_dequantize
    -Dstepserve_qg_rows_int8_b32=old_qg_rows_int8_b32 -Dstepserve_qg_rows_int8_k=old_qg_rows_int8_k"
OLD_SRC="quant_gemm.c"
for u in quant_gemm_int8_b32.c quant_gemm_int8_k.c; do
    git show "$OLD:replica/layers/csrc/$u" > "$D/old/$u" 2>/dev/null && OLD_SRC="$OLD_SRC $u"
done
OBJS=""
for f in $OLD_SRC; do
    $CC $RENAME -c "$D/old/$f" -o "$D/old-$f.o" & OBJS="$OBJS $D/old-$f.o"
done
for f in quant_gemm.c quant_gemm_int8_b32.c quant_gemm_int8_k.c; do
    $CC -c "replica/layers/csrc/$f" -o "$D/new-$f.o" & OBJS="$OBJS $D/new-$f.o"
done
wait
gcc -O2 -std=gnu11 -fopenmp bench/probes/quant_gemm_ab.c $OBJS -o "$D/ab" -lm
OMP_NUM_THREADS=1 "$D/ab" "${3:-3,8}" "${4:-1,8,16,32,63}" "${5:-7}"
rm -rf "$D"
