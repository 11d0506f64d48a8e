/* quant_gemm.c's int8 products of the K-quants (Q4_K, Q5_K, Q6_K): a translation unit of its own
 * so that it compiles beside the others (see stepserve_qg_rows_int8_k there). */
#define QG_INT8_UNIT 2
#include "quant_gemm.c"
