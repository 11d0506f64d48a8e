/* quant_gemm.c's int8 products of the block-32 types (Q4_0, Q4_1, Q8_0): a translation unit of its own
 * so that it compiles beside the others (see stepserve_qg_rows_int8_b32 there). */
#define QG_INT8_UNIT 1
#include "quant_gemm.c"
