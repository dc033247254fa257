// Config coop_128x128: cooperative persistent kernel, 128 x 128 CTA tile (two consumer warpgroups of 64 rows), no cluster.
#include "sm90_gemm.cuh"

TCFM_CONFIG(coop_128x128, 128, 128, 1, 1, tcfm_cutlass::Schedule::kCooperative, true)
